"""Where the shipped copier template lives, in a wheel and in a source checkout."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def template_dir() -> Path:
    """The copier template: `scaffold/templates` inside a wheel, `templates/` beside the package in a checkout."""
    for candidate in (_PACKAGE / "templates", _PACKAGE.parent / "templates"):
        if (candidate / "copier.yml").is_file():
            return candidate
    raise FileNotFoundError(
        f"scaffold's copier template is missing (looked in {_PACKAGE / 'templates'} and "
        f"{_PACKAGE.parent / 'templates'}); reinstall scaffold"
    )
