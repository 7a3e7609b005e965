"""Print the command of a README section: the one ```bash block under a `## <heading>`.

    python3 scripts/readme_commands.py "Set up and run"     # the set-up command
    python3 scripts/readme_commands.py "Run the tests"      # the test command

CI (.ci/run) runs what this prints, so that the README's commands are the ones CI runs and
the two cannot drift apart. The heading matches by its start ("Set up and run" finds
"## Set up and run (fresh Debian/Ubuntu, ...)"); the section ends at the next heading of
level 1 or 2. Anything but exactly one bash block there is an error (exit 1, one line):
CI must not guess which command the README means. Standard library only (it runs before
any virtual environment exists).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)[^`]*$")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


class ReadmeError(Exception):
    pass


def readme_command(text: str, heading: str) -> str:
    """The content of the one ```bash block in the `## heading...` section of `text`."""
    lines = text.splitlines()
    start, fence = None, None
    blocks: list[list[str]] = []
    block: list[str] | None = None
    for i, line in enumerate(lines):
        if fence is not None:  # inside a fenced block: only its closing fence counts
            if re.match(rf"^ {{0,3}}{fence[0]}{{{len(fence)},}}\s*$", line):
                if block is not None:
                    blocks.append(block)
                fence, block = None, None
            elif block is not None:
                block.append(line)
            continue
        if m := FENCE.match(line):
            fence = m.group(1)
            block = [] if start is not None and m.group(2).lower() == "bash" else None
            continue
        if m := HEADING.match(line):
            if start is not None and len(m.group(1)) <= 2:
                break  # the section ends
            if start is None and len(m.group(1)) == 2 and m.group(2).startswith(heading):
                start = i
    if start is None:
        raise ReadmeError(f"README.md has no '## {heading}' section")
    if fence is not None and start is not None and block is not None:
        raise ReadmeError(f"README.md '## {heading}': a ```bash block is never closed")
    if len(blocks) != 1:
        raise ReadmeError(
            f"README.md '## {heading}' holds {len(blocks)} ```bash blocks, not exactly one"
        )
    command = "\n".join(blocks[0]).strip()
    if not command:
        raise ReadmeError(f"README.md '## {heading}': its ```bash block is empty")
    return command


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print("usage: readme_commands.py HEADING [README]", file=sys.stderr)
        return 2
    path = Path(argv[2] if len(argv) == 3 else Path(__file__).resolve().parents[1] / "README.md")
    try:
        print(readme_command(path.read_text(encoding="utf-8"), argv[1]))
    except (OSError, ReadmeError) as e:
        print(f"readme_commands: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
