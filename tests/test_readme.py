"""The README's example runs as written, and the README stays short and links its docs."""

import os
import re

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", _readme(), flags=re.S)


def test_readme_example_runs(capsys):
    blocks = _blocks()
    assert len(blocks) == 3, (
        "the README has three python examples: the softmax, the training step, a transformers model"
    )
    exec(compile(blocks[0], "README.md", "exec"), {"__name__": "readme_example"})  # noqa: S102 - our own example
    out = capsys.readouterr().out
    assert out.count("bytes sent by this rank") == 4  # one line per rank


def test_readme_training_example_runs_strict(capsys):
    import math

    import shardops as so

    try:
        exec(compile(_blocks()[1], "README.md", "exec"), {"__name__": "readme_training"})  # noqa: S102
    finally:
        so.set_strict(False)
    losses = eval(capsys.readouterr().out.strip().splitlines()[-1])  # noqa: S307 - the list it printed
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert len(set(losses)) == 1  # the global loss, the same on every rank


def test_readme_transformers_example_runs():
    """The block runs on 4 ranks to the end (a failing rank raises in so.run); every rank returned."""
    source = _blocks()[2]
    assert source.rstrip().endswith("so.run(main, world_size=4)")
    namespace = {"__name__": "readme_transformers"}
    exec(
        compile(
            source.rstrip()[: -len("so.run(main, world_size=4)")] + "RESULTS = so.run(main, world_size=4)",
            "README.md",
            "exec",
        ),
        namespace,
    )  # noqa: S102
    assert len(namespace["RESULTS"]) == 4


def test_readme_is_short_and_its_links_exist():
    text = _readme()
    assert len(text.encode()) <= 12 * 1024
    for link in re.findall(r"\]\((docs/[^)]+)\)", text):
        assert os.path.exists(os.path.join(ROOT, link)), link
