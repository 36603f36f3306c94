from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = next(line.strip() for line in ci.splitlines() if "python3 -m venv" in line and not line.startswith("#"))
    assert f"    {command}\n" in readme
    assert readme.index("Set up and run the main job") < readme.index("Set up and pass the tests") < readme.index(command)
