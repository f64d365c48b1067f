"""Tree files shared by test_tree.py, test_zk.py and test_recipes.py."""

import os

HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLE = os.path.join(HERE, os.pardir, "etc", "tree.txt")  # the one shipped

TREE = """\
# a site
/lb
  variance = 4
  backlog_history = 9
  name = main site
  quoted = "1.0"
  /providers
  /workers
    history = 9999
    max_skill_age = 99990
    /providers
  backend -> /lb/workers
"""  # /lb/backend is a link to /lb/workers: recipes follow it
