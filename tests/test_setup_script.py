"""scripts/setup.sh: its options, checked without installing anything."""
import subprocess
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_an_unknown_option_exits_2_with_one_line_and_creates_nothing(tmp_path):
    venv = tmp_path / "venv"
    done = subprocess.run(["bash", "scripts/setup.sh", "--bogus"], cwd=REPO, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "VENV": str(venv)})
    assert done.returncode == 2
    assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1
    assert "--bogus" in done.stderr and "--bench" in done.stderr
    assert not venv.exists()


def test_the_bench_extra_setup_installs_is_the_one_pyproject_pins():
    # setup.sh --bench reads this list; pip install -e .[bench] would resolve openrlhf's flash-attn pin again
    bench = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["bench"]
    assert any(pin.startswith("dspy==") for pin in bench)
    script = (REPO / "scripts" / "setup.sh").read_text()
    assert '["optional-dependencies"]["bench"]' in script and "-c " in script
