#!/usr/bin/env python3
"""Prints the modules (paths relative to the modules dir) needed by the named ones, in load order."""
import os
import sys

moddir, wanted = sys.argv[1], sys.argv[2:]
deps = {}
with open(os.path.join(moddir, "modules.dep")) as f:
    for line in f:
        mod, _, rest = line.partition(":")
        deps[mod] = rest.split()
by_name = {os.path.basename(m)[: -len(".ko")].replace("-", "_"): m for m in deps}
order, seen = [], set()


def visit(m):
    if m in seen:
        return
    seen.add(m)
    # modules.dep lists a module's dependencies with the deepest last: load them in reverse.
    for d in reversed(deps.get(m, [])):
        visit(d)
    order.append(m)


for name in wanted:
    m = by_name.get(name.replace("-", "_"))
    if m is None:
        sys.exit(f"no module {name}")
    visit(m)
print("\n".join(order))
