"""LogEvent: a gevent Event set when a logger logs a given text, for
tests that wait on what a component says instead of sleeping."""

import logging

import gevent.event


class LogEvent(logging.Handler):
    """An event set when logger ``name`` logs a message containing ``text``;
    ``with LogEvent(name, text) as event: ...`` listens within the block."""

    def __init__(self, name, text):
        super().__init__()
        self.logger, self.text = logging.getLogger(name), text
        self.event = gevent.event.Event()

    def emit(self, record):
        if self.text in record.getMessage():
            self.event.set()

    def __enter__(self):
        self.logger.addHandler(self)
        return self.event

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
