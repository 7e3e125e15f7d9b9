"""The README's train loop is the example's file, so the documented code is the code that runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_train_loop_is_the_example():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("This is `examples/gpt/train.py`, complete:\n\n```python\n")[1]
    block = block.split("```")[0]
    source = (ROOT / "examples" / "gpt" / "train.py").read_text()
    assert source.endswith(block), "README's train loop differs from examples/gpt/train.py"
