"""`agent-runner bench`: the standard scenario, timed through the service layer and HTTP.

scenario.py defines the work (tools, model, agents file); service.py and http.py time it;
database.py counts transactions, sizes what is stored and measures the commit floor;
report.py prints the figures; suite.py runs it all. Nothing is imported here, so the
scenario's python tools (`app.bench.scenario:get_issue`) load without the rest of the bench.
"""
