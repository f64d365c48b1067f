"""Tests for zc_lb.worker.resume: decayed per-class rates and the résumé file."""

from __future__ import annotations

import json
import logging
import os
import random

import orjson
import pytest

from zc_lb.errors import ConfigurationError
from zc_lb.wire import encoder, frames
from zc_lb.wire.decoder import ResumeFrame
from zc_lb.wire.intake import ResumeIntake
from zc_lb.worker.publisher import ResumePublisher
from zc_lb.worker.resume import (DEFAULT_HISTORY, MAX_CLASSES, MAX_FILE, MIN_ELAPSED, RESUME_BYTES,
                                 Skills, load_resume, save_resume)


class EagerSkills:
    """The reference: every request decays every class at once."""

    def __init__(self, history: int, seed: dict = None) -> None:
        self.decay = 1.0 - 1.0 / history
        self.count = {c: 1.0 for c in seed or {}}
        self.seconds = {c: 1.0 / s for c, s in (seed or {}).items()}

    def record(self, rclass: str, elapsed: float) -> None:
        for c in self.count:
            self.count[c] *= self.decay
            self.seconds[c] *= self.decay
        self.count[rclass] = self.count.get(rclass, 0.0) + 1.0
        self.seconds[rclass] = self.seconds.get(rclass, 0.0) + max(elapsed, MIN_ELAPSED)

    def resume(self) -> dict:
        return {c: self.count[c] / self.seconds[c] for c in self.count}


def test_single_class_score_is_count_over_seconds():
    skills = Skills(history=100)
    for _ in range(10):
        skills.record("a", 0.25)
    assert skills.resume() == {"a": pytest.approx(4.0)}
    # Any history: with one constant duration, decay cancels out.
    skills = Skills(history=2)
    for _ in range(10):
        skills.record("a", 0.5)
    assert skills.resume() == {"a": pytest.approx(2.0)}


def test_score_by_hand_without_decay_effect():
    # history=1: decay 0, so only the latest sample counts.
    skills = Skills(history=1)
    skills.record("a", 1.0)
    skills.record("a", 0.1)
    assert skills.resume() == {"a": pytest.approx(10.0)}


def test_decay_weights_recent_samples_more():
    skills = Skills(history=2)  # decay 1/2
    for _ in range(5):
        skills.record("a", 1.0)
    skills.record("a", 0.1)
    skills.record("a", 0.1)
    # count = 1/2^6 + ... + 1/2 + 1 summed over 7 samples, seconds likewise
    weights = [0.5 ** k for k in range(7)]  # newest first
    samples = [0.1, 0.1, 1.0, 1.0, 1.0, 1.0, 1.0]
    expected = sum(weights) / sum(w * s for w, s in zip(weights, samples))
    assert skills.resume()["a"] == pytest.approx(expected)
    undecayed = 7 / sum(samples)
    assert skills.resume()["a"] > 2 * undecayed  # the two fast ones dominate


def test_lazy_decay_equals_eager_decay():
    rng = random.Random(11)
    seed = {"c0": 3.0, "seeded-only": 0.5}
    lazy = Skills(history=7, max_skill_age=10**9, resume=seed)
    eager = EagerSkills(7, seed)
    classes = ["c%d" % i for i in range(6)]
    for _ in range(500):
        rclass = rng.choice(classes[:2] * 5 + classes)  # some busy, some rare
        elapsed = rng.choice([0.0, rng.uniform(0.001, 2.0)])
        lazy.record(rclass, elapsed)
        eager.record(rclass, elapsed)
        expected = eager.resume()
        got = lazy.resume()
        assert got.keys() == expected.keys()
        for rclass in expected:
            assert got[rclass] == pytest.approx(expected[rclass], rel=1e-9)


def test_record_returns_a_resume_exactly_every_history_requests():
    skills = Skills(history=5)
    published = []
    for i in range(1, 23):
        result = skills.record("a" if i % 2 else "b", 0.5)
        if result is not None:
            published.append(i)
            assert result == skills.resume()
            assert result is not skills.resume()
    assert published == [5, 10, 15, 20]
    assert skills.generation == 22


def test_classes_unseen_for_max_skill_age_are_pruned():
    skills = Skills(history=2, max_skill_age=4)
    skills.record("old", 1.0)  # generation 1
    published = {}
    for generation in range(2, 12):
        result = skills.record("new", 1.0)
        if result is not None:
            published[generation] = set(result)
    # Seen 1 and 3 requests ago: kept; 5 requests ago: gone.
    assert published[2] == published[4] == {"old", "new"}
    assert published[6] == published[8] == published[10] == {"new"}
    assert len(skills) == 1


def test_prune_returns_what_it_dropped():
    skills = Skills(history=1000, max_skill_age=3, resume={"seeded": 1.0})
    for rclass in "abcde":
        skills.record(rclass, 1.0)
    assert sorted(skills.prune()) == ["a", "seeded"]
    assert set(skills.resume()) == {"b", "c", "d", "e"}
    assert skills.prune() == []


def test_past_max_classes_the_least_requested_are_pruned():
    # A flood of Host names sent once would keep a hundred thousand
    # classes (max_skill_age) in the résumé every LB takes in.
    skills = Skills(history=1000, max_classes=3)
    for rclass, times in (("a", 5), ("b", 1), ("c", 4), ("d", 1), ("e", 3)):
        for _ in range(times):
            skills.record(rclass, 0.01)
    skills.record("b", 0.01)  # b: twice, d: once, the longest ago
    assert sorted(skills.prune()) == ["b", "d"]
    assert set(skills.resume()) == {"a", "c", "e"}
    assert skills.prune() == []


def test_a_flood_of_classes_seen_once_keeps_the_resume_at_max_classes():
    skills = Skills(history=1000, max_skill_age=10**6)
    resume = None
    for n in range(2 * MAX_CLASSES):
        resume = skills.record("new%d" % n if n % 4 else "site", 0.01) or resume
    assert resume is not None and len(resume) == MAX_CLASSES and "site" in resume


def test_between_prunes_the_classes_and_any_resume_stay_near_max_classes():
    # The dict reached max_classes + history classes between prunes (13,767
    # against 10,000), and a résumé sent then (to a new LB) carried them all.
    skills = Skills(history=5000, max_skill_age=10**6, max_classes=1000)
    for n in range(4000):
        skills.record("site" if n % 4 == 0 else "new%d" % n, 0.01)
        assert len(skills) <= skills.prune_at == 1100
    resume = skills.resume()
    assert len(resume) == 1000 and "site" in resume


def test_max_classes_is_a_live_setting():
    skills = Skills(history=10)
    for n in range(10):
        skills.record("c%d" % n, 0.01)
    assert len(skills) == 10 and skills.max_classes == MAX_CLASSES
    skills.configure(10, None, 4)  # fewer classes kept from the next résumé on
    assert len(skills) == 10 and len(skills.resume()) == 4
    resume = None
    for _ in range(10):
        resume = skills.record("c9", 0.01) or resume
    assert resume is not None and len(resume) == 4 and "c9" in resume
    for bad in (0, -1, 2.5, "4", None, True):
        with pytest.raises(ConfigurationError):
            skills.configure(10, None, bad)
    assert skills.max_classes == 4


def test_default_max_skill_age_is_ten_histories():
    assert Skills().history == DEFAULT_HISTORY
    assert Skills().max_skill_age == 10 * DEFAULT_HISTORY
    skills = Skills(history=3)
    assert skills.max_skill_age == 30
    skills.record("old", 1.0)
    for _ in range(29):
        skills.record("new", 1.0)
    assert "old" in skills.resume()  # at the publish of 30, seen 29 requests ago
    for _ in range(3):
        skills.record("new", 1.0)
    assert "old" not in skills.resume()


def test_a_resume_too_big_for_a_frame_keeps_the_most_requested_classes_that_fit(caplog):
    # A client sending a new, long Host with every request made a résumé
    # the LB refused, and it dropped the worker's connection, again on
    # every reconnection: the worker was lost for good.
    skills = Skills(history=1000)
    for n in range(200):
        skills.record("h%03d-%s" % (n, "a" * 80), 0.01)
    for _ in range(5):
        skills.record("site", 0.01)
        skills.record("other", 0.02)
    whole = skills.resume()
    assert len(whole) == 202 and len(encoder._json(whole)) > 4000
    resume = skills.resume(max_bytes=4000)
    assert len(orjson.dumps(resume)) <= 4000 < len(encoder._json(resume)) + 120
    assert resume["site"] == whole["site"] and resume["other"] == whole["other"]
    assert set(resume) < set(whole)
    kept = sorted(int(rclass[1:].partition("-")[0]) for rclass in resume
                  if rclass.startswith("h"))
    assert kept == list(range(200 - len(kept), 200))  # the most recent, by decayed count
    assert "sending the %d most requested" % len(resume) in caplog.text


def test_the_resume_limit_is_under_what_an_lb_takes():
    assert RESUME_BYTES < frames.RESUME_LIMIT < frames.MAX_RESUME
    # (the frame's header comes on top of the payload)
    assert RESUME_BYTES + frames.HEADER.size <= frames.RESUME_LIMIT
    assert MAX_CLASSES < frames.RESUME_CLASSES
    from zc_lb.settings import WORKER_SETTINGS  # (its bound written out: see there)
    assert WORKER_SETTINGS["max_classes"].maximum == frames.RESUME_CLASSES


def test_a_resume_never_goes_past_what_an_lb_takes_and_the_log_says_so_once(caplog):
    # Classes of long names by the tens of thousands (max_classes raised
    # as far as it goes): the résumé keeps the most requested that fit
    # in what an LB takes, and says so once, not at every résumé.
    skills = Skills(history=10**6, max_classes=frames.RESUME_CLASSES)
    for n in range(40000):
        skills.record("h%05d.example/%s" % (n, "p" * 120), 0.01)
    skills.record("site", 0.01)
    skills.record("site", 0.01)
    with caplog.at_level(logging.WARNING, logger="zc_lb.worker.resume"):
        first, second = skills.resume(), skills.resume()
    assert len(encoder._json(first)) <= RESUME_BYTES and "site" in first
    assert first == second and 20000 < len(first) < 40000
    intake = ResumeIntake(clock=lambda: 0.0)
    payload = encoder.encode(frames.Resume(first))[frames.HEADER.size:]
    assert intake.offer(ResumeFrame([payload], len(payload))) == frames.Resume(first)
    lines = [r for r in caplog.records if "most requested" in r.getMessage()]
    assert len(lines) == 1 and skills.cut == 2


def test_max_classes_is_no_more_than_an_lb_takes():
    Skills(max_classes=frames.RESUME_CLASSES)
    with pytest.raises(ConfigurationError):
        Skills(max_classes=frames.RESUME_CLASSES + 1)


def test_initial_resume_seeds_scores():
    skills = Skills(history=2, resume={"a": 4.0, "b": 2, "zero": 0, "neg": -1.0, 3: 1.5})
    assert skills.resume() == {"a": 4.0, "b": 2.0, "3": 1.5}
    assert len(skills) == 3
    # A seeded class counts as one request of 1/score seconds.
    skills.record("a", 1.0)
    assert skills.resume()["a"] == pytest.approx((0.5 + 1) / (0.25 * 0.5 + 1.0))
    assert skills.resume()["b"] == 2.0  # idle classes keep their score


def test_zero_or_negative_elapsed_is_clamped():
    skills = Skills(history=10)
    skills.record("a", 0.0)
    skills.record("b", -5.0)
    assert skills.resume() == {"a": pytest.approx(1 / MIN_ELAPSED),
                               "b": pytest.approx(1 / MIN_ELAPSED)}


@pytest.mark.parametrize("history,max_skill_age", [
    (0, None), (-1, None), (1.5, None), ("9", None), (None, None), (True, 0),
    (9, 0), (9, -1), (9, 2.5), (9, "90"),
])
def test_configure_validates(history, max_skill_age):
    with pytest.raises(ConfigurationError):
        Skills(history=history, max_skill_age=max_skill_age)
    skills = Skills(history=9, max_skill_age=50)
    with pytest.raises(ConfigurationError):
        skills.configure(history, max_skill_age)
    assert (skills.history, skills.max_skill_age, skills.decay) == (9, 50, 1 - 1 / 9)


def test_configure_changes_settings_live():
    skills = Skills(history=9)
    skills.record("a", 1.0)
    skills.configure(4)
    assert (skills.history, skills.max_skill_age, skills.decay) == (4, 40, 0.75)
    skills.configure(4, 7)
    assert skills.max_skill_age == 7
    # Publishing now follows the new history.
    results = [skills.record("a", 1.0) is not None for _ in range(7)]
    assert results == [False, False, True, False, False, False, True]


def test_repr():
    skills = Skills(history=3)
    skills.record("a", 1.0)
    assert repr(skills) == "<Skills classes=1 generation=1 history=3>"


# -- the résumé file ---------------------------------------------------------------


def test_save_then_load_round_trips(tmp_path):
    path = str(tmp_path / "resume.json")
    resume = {"example.com": 12.5, "\u00e9t\u00e9": 1e-9, "": 3.0, "big": 1e300}
    save_resume(path, resume)
    assert load_resume(path).skills == resume
    with open(path, encoding="utf-8") as f:
        assert json.load(f) == {"zc_lb_resume": 2, "reset_skills": None, "skills": resume}
    assert os.listdir(tmp_path) == ["resume.json"]


def test_the_file_keeps_the_reset_token_and_format_1_is_still_read(tmp_path):
    path = tmp_path / "resume.json"
    save_resume(str(path), {"a": 1.0}, "2026-11-30T20:00")
    assert load_resume(str(path)) == ({"a": 1.0}, "2026-11-30T20:00")
    path.write_text('{"a": 2.5}')  # format 1: the skills alone, their token not known
    assert load_resume(str(path)) == ({"a": 2.5}, None)


def test_save_replaces_the_old_file(tmp_path):
    path = str(tmp_path / "resume.json")
    save_resume(path, {"a": 1.0})
    save_resume(path, {"b": 2.0})
    assert load_resume(path).skills == {"b": 2.0}
    save_resume(path, {})
    assert load_resume(path).skills == {}
    assert os.listdir(tmp_path) == ["resume.json"]


def test_save_relative_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_resume("r.json", {"a": 1.0})
    assert load_resume(str(tmp_path / "r.json")).skills == {"a": 1.0}
    assert os.listdir(tmp_path) == ["r.json"]


def test_save_writes_a_complete_temp_file_then_replaces(tmp_path, monkeypatch):
    path = str(tmp_path / "resume.json")
    save_resume(path, {"old": 1.0})
    real_replace, real_fsync = os.replace, os.fsync
    seen = []

    def fsync(fd):
        seen.append("fsync")
        real_fsync(fd)

    def replace(src, dst):
        seen.append("replace")
        # The new content is complete in a temporary file in the same
        # directory, and the destination still holds the old one.
        assert os.path.dirname(os.path.abspath(src)) == str(tmp_path)
        assert os.path.abspath(dst) == path and os.path.abspath(src) != path
        with open(src, encoding="utf-8") as f:
            assert json.load(f)["skills"] == {"new": 2.0}
        assert load_resume(path).skills == {"old": 1.0}
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "fsync", fsync)
    save_resume(path, {"new": 2.0})
    assert seen == ["fsync", "replace"]
    assert load_resume(path).skills == {"new": 2.0}
    assert os.listdir(tmp_path) == ["resume.json"]


@pytest.mark.parametrize("bad", [{"a": object()}, {"a": 1.0, "b": {1, 2}}, {"a": 1.0, 2: 1.0}])
def test_failed_save_leaves_old_file_and_no_temp_file(tmp_path, bad):
    path = str(tmp_path / "resume.json")
    save_resume(path, {"old": 1.0})
    with pytest.raises(TypeError):
        save_resume(path, bad)
    assert load_resume(path).skills == {"old": 1.0}
    assert os.listdir(tmp_path) == ["resume.json"]


def test_failed_replace_leaves_no_temp_file(tmp_path, monkeypatch):
    path = str(tmp_path / "resume.json")

    def replace(src, dst):
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="disk on fire"):
        save_resume(path, {"a": 1.0})
    assert os.listdir(tmp_path) == []


def test_save_into_a_missing_directory_fails_cleanly(tmp_path):
    with pytest.raises(OSError):
        save_resume(str(tmp_path / "nope" / "resume.json"), {"a": 1.0})
    assert os.listdir(tmp_path) == []


def test_load_missing_file_is_empty(tmp_path):
    assert load_resume(str(tmp_path / "missing.json")).skills == {}


def test_load_accepts_integers_as_floats(tmp_path):
    path = tmp_path / "resume.json"
    path.write_text('{"a": 3, "b": 0.5}')
    loaded = load_resume(str(path)).skills
    assert loaded == {"a": 3.0, "b": 0.5}
    assert all(type(v) is float for v in loaded.values())


@pytest.mark.parametrize("content", [
    b"", b"not json", b"{", b"\xff\xfe\x00", b"[]", b'["a", 1.0]', b"1.5", b'"a"', b"null",
    b'{"a": "1"}', b'{"a": 0}', b'{"a": -1.5}', b'{"a": true}', b'{"a": null}',
    b'{"a": [1]}', b'{"a": NaN}', b'{"ok": 1.0, "a": {}}',
    # (a worker seeded with an infinite score failed dividing by zero on
    # its first résumé, at every LB's connection; one too small for its
    # inverse to be finite sent a score of 0)
    b'{"a": Infinity}', b'{"a": 1e-320}', b'{"a": 1%s}' % (b"0" * 400),
    # format 2's: a newer format, no skills object, a token not a string
    b'{"zc_lb_resume": 3, "skills": {}}', b'{"zc_lb_resume": 2, "skills": [1]}',
    b'{"zc_lb_resume": 2, "reset_skills": 5, "skills": {}}',
    b'{"zc_lb_resume": 2, "skills": {"a": -1}}',
])
def test_load_garbage_or_bad_scores_names_the_file(tmp_path, content):
    path = tmp_path / "resume.json"
    path.write_bytes(content)
    with pytest.raises(ConfigurationError) as info:
        load_resume(str(path))
    assert str(path) in str(info.value)


def test_load_a_directory_names_it(tmp_path):
    with pytest.raises(ConfigurationError) as info:
        load_resume(str(tmp_path))
    assert str(tmp_path) in str(info.value)


def test_skills_survive_a_restart_through_the_file(tmp_path):
    path = str(tmp_path / "resume.json")
    skills = Skills(history=4)
    published = None
    for i in range(8):
        published = skills.record("a" if i % 3 else "b", 0.2 if i % 3 else 0.5) or published
    save_resume(path, published)
    restarted = Skills(history=4, resume=load_resume(path).skills)
    assert restarted.resume() == pytest.approx(published)



class NoLBs:
    """A worker's LBs, none connected: what ``ResumePublisher`` sends them."""

    def __init__(self):
        self.sent = []

    def send_resume(self, skills):
        self.sent.append(dict(skills))


@pytest.mark.parametrize("content", [b"[" * 100000, b'{"a": ' * 100000])
def test_a_file_nested_too_deep_is_moved_aside_not_a_crash(tmp_path, content):
    # (json.load raised RecursionError, which stopped the worker at start
    # with a traceback)
    path = tmp_path / "resume.json"
    path.write_bytes(content)
    with pytest.raises(ConfigurationError, match="is not JSON") as info:
        load_resume(str(path))
    assert str(path) in str(info.value)
    publisher = ResumePublisher(NoLBs(), resume_file=str(path))
    publisher.start()
    publisher.stop()
    assert len(publisher.skills) == 0
    assert (tmp_path / "resume.json.corrupt").read_bytes() == content


def test_a_file_bigger_than_any_resume_is_corrupt_and_not_read(tmp_path):
    path = tmp_path / "resume.json"
    with open(path, "wb") as f:
        f.truncate(MAX_FILE + 1)  # (sparse: a gigabyte would do as well)
    with pytest.raises(ConfigurationError, match="is %d bytes, over the %d of any résumé"
                       % (MAX_FILE + 1, MAX_FILE)):
        load_resume(str(path))


def test_the_file_is_compact_utf8_so_the_biggest_resume_fits_max_file(tmp_path):
    # (json.dump's \uXXXX escapes made a résumé of non-ASCII classes up
    # to six times its size on the wire)
    path = tmp_path / "resume.json"
    resume = {"\u00e9t\u00e9-%d" % i: 1.5 for i in range(1000)}
    save_resume(str(path), resume, "token")
    header = len(b'{"reset_skills":"token","skills":,"zc_lb_resume":2}')
    assert path.stat().st_size == len(orjson.dumps(resume)) + header
    assert MAX_FILE >= RESUME_BYTES + header + 1024 * 1024
    assert load_resume(str(path)) == (resume, "token")


def test_a_stopping_worker_saves_what_it_learnt_since_the_last_resume(tmp_path):
    # (skills learnt since the last résumé were lost at every restart:
    # up to history - 1 requests' worth, all of them with resume_interval 0)
    path = tmp_path / "resume.json"
    lbs = NoLBs()
    publisher = ResumePublisher(lbs, history=100, resume_interval=0, resume_file=str(path))
    publisher.start()
    for _ in range(50):
        publisher.record("a.example", 0.01)
    publisher.stop()
    assert lbs.sent == [] and load_resume(str(path)).skills == {"a.example": pytest.approx(100)}
    path.unlink()
    publisher.stop()  # (nothing new: nothing written)
    assert not path.exists()


def test_a_resume_file_that_is_a_link_stays_one(tmp_path):
    # (the save replaced the link by a file of its own, beside it)
    (tmp_path / "var").mkdir()
    (tmp_path / "etc").mkdir()
    target, link = tmp_path / "var" / "resume.json", tmp_path / "etc" / "resume.json"
    link.symlink_to(target)
    save_resume(str(link), {"a": 1.0})
    assert link.is_symlink() and load_resume(str(target)).skills == {"a": 1.0}
    assert os.listdir(tmp_path / "etc") == ["resume.json"]
    assert os.listdir(tmp_path / "var") == ["resume.json"]
    target.write_text("garbage")  # moved aside where it is
    publisher = ResumePublisher(NoLBs(), resume_file=str(link))
    publisher.start()
    publisher.stop()
    assert link.is_symlink() and not target.exists()
    assert (tmp_path / "var" / "resume.json.corrupt").read_text() == "garbage"


def test_two_workers_given_one_file_do_not_write_over_each_other(tmp_path, caplog):
    # (each saved its own skills over the other's, and each restart got
    # whichever worker saved last)
    path = tmp_path / "resume.json"
    first, second = (ResumePublisher(NoLBs(), history=2, resume_file=str(path))
                     for _ in range(2))
    first.start()
    second.start()
    assert "résumé file %s is in use by another worker (pid %d)" % (
        path, os.getpid()) in caplog.text
    second.record("second.example", 0.1)
    second.record("second.example", 0.1)  # (a résumé: sent, not saved)
    assert second.lbs.sent and not path.exists()
    first.record("first.example", 0.1)
    first.record("first.example", 0.1)
    assert list(load_resume(str(path)).skills) == ["first.example"]
    first.stop()  # frees it: the other saves from now on
    second.record("second.example", 0.1)
    second.record("second.example", 0.1)
    assert list(load_resume(str(path)).skills) == ["second.example"]
    second.stop()
    assert "resume.json.corrupt" not in os.listdir(tmp_path)


def test_a_temporary_file_left_by_a_killed_save_is_removed_at_start(tmp_path):
    path = tmp_path / "resume.json"
    save_resume(str(path), {"a": 1.0})
    (tmp_path / ".resume.json.tmp").write_bytes(b'{"zc_lb_resume": 2, "sk')  # (killed here)
    (tmp_path / ".other.json.tmp").write_bytes(b"another worker's")
    publisher = ResumePublisher(NoLBs(), resume_file=str(path))
    publisher.start()
    assert sorted(os.listdir(tmp_path)) == [".other.json.tmp", ".resume.json.lock",
                                            "resume.json"]
    assert publisher.skills.resume() == {"a": 1.0}
    publisher.stop()
