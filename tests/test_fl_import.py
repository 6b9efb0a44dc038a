"""`import edgetrain` never imports Flower; `edgetrain.fl` does, lazily, and says what to install."""

import subprocess
import sys


def test_import_edgetrain_does_not_import_flwr():
    code = ("import sys, edgetrain, edgetrain.cli.main\n"
            "bad = sorted(m for m in sys.modules if m == 'flwr' or m.startswith(('flwr.', 'ray')))\n"
            "print('LOADED', bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "LOADED []" in out.stdout, out.stdout


def test_edgetrain_fl_without_flwr_says_what_to_install():
    # a meta-path finder that refuses flwr stands in for an environment without it
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'flwr' or name.startswith('flwr.'):\n"
            "            raise ImportError('No module named ' + repr(name))\n"
            "sys.meta_path.insert(0, Block())\n"
            "try:\n"
            "    import edgetrain.fl\n"
            "except ImportError as e:\n"
            "    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ERR edgetrain.fl needs Flower: pip install 'edgetrain[flower]'" in out.stdout, out.stdout + out.stderr
