#!/usr/bin/env python3
"""Fails when a room of src/ names another room that ARCHITECTURE.md does not allow.

The rules are the ```rooms block of ARCHITECTURE.md: `room: a b x::y` lists the rooms (or one
module `y` of room `x`) that `room` may name (`*`: any); `private x::y -> r s` lets only rooms
r and s (and x itself) name `x::y`.
A room is the first component of a path under src/ (`store/memory.rs` is in `store`). Only
code outside `#[cfg(test)]` modules counts: tests may reach for doubles anywhere.
"""
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def rules():
    text = open(os.path.join(ROOT, "ARCHITECTURE.md")).read()
    block = re.search(r"```rooms\n(.*?)```", text, re.S)
    if not block:
        sys.exit("ARCHITECTURE.md has no ```rooms block")
    allowed, private = {}, {}
    for line in block.group(1).splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("private "):
            path, _, rooms = line[len("private "):].partition("->")
            private[path.strip()] = set(rooms.split())
            continue
        room, _, names = line.partition(":")
        allowed[room.strip()] = set(names.split())
    return allowed, private


def without_tests(code):
    """The code before the first `#[cfg(test)]` item that opens a module."""
    m = re.search(r"#\[cfg\(test\)\]\s*(pub(\(\w+\))?\s+)?mod\s+\w+\s*\{", code)
    return code[: m.start()] if m else code


def test_only(path):
    """Whether the module in `path` is declared `#[cfg(test)] mod name;` by its parent."""
    name = os.path.basename(path).removesuffix(".rs")
    folder = os.path.dirname(path)
    parents = [os.path.join(folder, "mod.rs"), folder + ".rs", os.path.join(folder, "lib.rs")]
    pattern = r"#\[cfg\(test\)\]\s*(pub(\(\w+\))?\s+)?mod\s+" + name + r"\s*;"
    for parent in parents:
        if parent != path and os.path.exists(parent) and re.search(pattern, open(parent).read()):
            return True
    return False


def allows(names, other, sub):
    return "*" in names or other in names or (sub is not None and f"{other}::{sub}" in names)


def main():
    allowed, private = rules()
    src = os.path.join(ROOT, "src")
    problems = []
    for dirpath, _, files in os.walk(src):
        for name in sorted(files):
            if not name.endswith(".rs"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, src)
            room = rel.split(os.sep)[0].removesuffix(".rs")
            if room not in allowed:
                problems.append(f"{rel}: room `{room}` is not in ARCHITECTURE.md's rooms block")
                continue
            if test_only(path):
                continue
            code = without_tests(open(path).read())
            code = re.sub(r"//.*", "", code)
            prefix = "ferry" if room == "main" else "crate"
            for m in re.finditer(prefix + r"::([a-z_0-9]+)(?:::([a-z_0-9]+))?", code):
                other, sub = m.group(1), m.group(2)
                line = code.count("\n", 0, m.start()) + 1
                if other == room:
                    continue
                if not allows(allowed[room], other, sub):
                    problems.append(f"{rel}:{line}: `{room}` may not name `{other}` (`{m.group(0)}`)")
                key = f"{other}::{sub}" if sub else None
                if key in private and room not in private[key]:
                    problems.append(f"{rel}:{line}: only {sorted(private[key])} may name `{key}`")
    for p in problems:
        print(p)
    if problems:
        sys.exit(f"check-rooms: {len(problems)} import(s) break ARCHITECTURE.md's rules")
    print("check-rooms: every room imports only what ARCHITECTURE.md allows")


if __name__ == "__main__":
    main()
