#!/usr/bin/env python3
"""Lints a chart with the real Helm library (helm-sdkpy bundles Helm v4) and prints the
messages as JSON: {"errors": [...], "messages": [...]}. Exit status 0 either way; the caller
decides."""
import asyncio
import json
import sys

import helm_sdkpy


def main():
    result = asyncio.run(helm_sdkpy.Lint(helm_sdkpy.Configuration()).run(sys.argv[1]))
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
