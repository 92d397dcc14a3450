"""What the Python tests of the project's scripts share: load a script of the checkout as a
module, and PASS/FAIL lines that end the test with the count of failures."""
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_module(name, *path_in_checkout):
    """The checkout's file ROOT/path_in_checkout, imported as module `name`."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, *path_in_checkout))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Checks:
    def __init__(self):
        self.failed = []

    def check(self, name, ok, detail=""):
        print(f'{"PASS" if ok else "FAIL"} {name}{": " + str(detail) if detail else ""}')
        if not ok:
            self.failed.append(name)

    def finish(self):
        print(f"{len(self.failed)} failed: {', '.join(self.failed)}" if self.failed else "all passed")
        sys.exit(1 if self.failed else 0)
