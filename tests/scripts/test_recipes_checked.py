"""Recipe files get the command line's checks (types, choices, flags), with errors naming the file and the key."""

import pytest

from attnzoo.training.recipes import parse_with_recipe
from tests.scripts_helpers import load_script


def parse(argv):
    return parse_with_recipe(load_script("train_lm").build_parser(), argv)


@pytest.mark.parametrize("text, message", [
    ("max_train_steps: 2.5\n", r"max_train_steps: 2.5 is invalid: use a whole number"),
    ("mixed_precision: fp8\n", r"mixed_precision: 'fp8' is invalid: use one of \['no', 'bf16', 'fp16'\]"),
    ("learning_rate: fast\n", r"learning_rate: 'fast' is invalid: use a number"),
    ("overwrite_output_dir: yes please\n", r"overwrite_output_dir: 'yes please' is invalid: use true or false"),
    ("- a\n- b\n", r"holds a list; a recipe is a mapping of argument names to values"),
    ("max_train_steps: [1\n", r"is not valid YAML"),
])
def test_bad_recipe_values_are_refused_naming_the_file_and_key(tmp_path, text, message):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(text)
    with pytest.raises(ValueError, match=message) as error:
        parse(["--recipe", str(recipe)])
    assert str(recipe) in str(error.value)


def test_a_folder_or_a_missing_file_as_recipe_says_so(tmp_path):
    with pytest.raises(ValueError, match=r"--recipe .* is a folder; name a YAML file"):
        parse(["--recipe", str(tmp_path)])
    with pytest.raises(ValueError, match=r"--recipe .* does not exist"):
        parse(["--recipe", str(tmp_path / "missing.yaml")])
