"""Evaluates a ValidatingAdmissionPolicy's CEL the way the API server does, for test cases.

stdin: {"policy": <the rendered policy>, "cases": [{"name", "request", "object", "oldObject"}]}
stdout: {"<name>": "allowed" | "not matched" | "denied: <message>"} (JSON)

Uses cel-python (standard CEL with its macros); Kubernetes adds library functions the policy
does not use. matchConditions gate the policy; variables are evaluated in order and exposed as
`variables.<name>`; every validation must be true.
"""
import json
import sys

import celpy


def main():
    data = json.load(sys.stdin)
    spec = data["policy"]["spec"]
    env = celpy.Environment()

    def run(expr, activation):
        program = env.program(env.compile(expr))
        return program.evaluate(activation)

    results = {}
    for case in data["cases"]:
        base = {k: celpy.json_to_cel(case[k]) for k in ("request", "object", "oldObject")}
        if not all(bool(run(c["expression"], base)) for c in spec.get("matchConditions", [])):
            results[case["name"]] = "not matched"
            continue
        variables = {}
        for v in spec.get("variables", []):
            activation = dict(base, variables=celpy.celtypes.MapType(variables))
            variables[celpy.celtypes.StringType(v["name"])] = run(v["expression"], activation)
        activation = dict(base, variables=celpy.celtypes.MapType(variables))
        verdict = "allowed"
        for check in spec["validations"]:
            if not bool(run(check["expression"], activation)):
                verdict = "denied: " + check["message"]
                break
        results[case["name"]] = verdict
    json.dump(results, sys.stdout)


main()
