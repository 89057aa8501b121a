"""Child process for the crash tests: does every write of a store operation, then stops just before COMMIT
until it is killed.  Usage: python pause_before_commit.py STORE_URL promote VERSION | add_version"""
import sys, time
from templates.gate import Decision
from templates.store import TemplateStore
from templates.template import Template
store = TemplateStore(sys.argv[1])
real = store._db._conn

class PauseBeforeCommit:
    # Do every write of the operation, then stop just before COMMIT until killed.
    def __getattr__(self, name):
        return getattr(real, name)

    def execute(self, sql, *args):
        if sql == "COMMIT":
            print("written, not committed", flush=True)
            time.sleep(60)
        return real.execute(sql, *args)

store._db._conn = PauseBeforeCommit()
if sys.argv[2] == "promote":
    store.promote("risk", int(sys.argv[3]))
else:
    store.add_version("risk", Template.from_text("half-written {text}"), decision=Decision(True, ()))
