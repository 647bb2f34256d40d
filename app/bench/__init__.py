"""`agent-runner bench`: the standard scenario, timed through the service layer and HTTP.

scenario.py defines the work (tools, model, agents file), service.py and http.py measure it,
report.py prints it, suite.py runs it all. Nothing is imported here, so the scenario's python
tools (`app.bench.scenario:get_issue`) load without the rest of the bench.
"""
