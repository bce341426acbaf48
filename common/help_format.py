"""An argparse help formatter that shows each flag's default, but only where there is one to show."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends `(default: X)` to a flag's help unless X is None, False or empty, or the help already
    says `default`."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or default in (None, False, [], "") or default is argparse.SUPPRESS
                or action.option_strings == []):
            return text
        return f"{text} (default: %(default)s)"
