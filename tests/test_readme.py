"""The README's example runs as written, and the README stays short and links its docs."""
import os
import re

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_readme_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", _readme(), flags=re.S)
    assert len(blocks) == 1, "the README has one python example"
    exec(compile(blocks[0], "README.md", "exec"), {"__name__": "readme_example"})  # noqa: S102 - our own example
    out = capsys.readouterr().out
    assert out.count("bytes sent by this rank") == 4  # one line per rank


def test_readme_is_short_and_its_links_exist():
    text = _readme()
    assert len(text.encode()) <= 12 * 1024
    for link in re.findall(r"\]\((docs/[^)]+)\)", text):
        assert os.path.exists(os.path.join(ROOT, link)), link
