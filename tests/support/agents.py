"""The agents file the HTTP-level tests use: HTTP tools on the ToolServer, fake-model plans."""

from __future__ import annotations

from pathlib import Path

TEMPLATE = """
tools:
  get_issue:
    description: Fetch an issue by id
    input_schema: {{type: object, properties: {{id: {{type: string}}}}, required: [id]}}
    safe_to_retry: true
    http: {{url: "{tools}/get_issue", timeout_s: 10}}
  post_slack:
    description: Post a message to a channel
    input_schema:
      type: object
      properties: {{channel: {{type: string}}, text: {{type: string}}}}
      required: [channel, text]
    http: {{url: "{tools}/post_slack"}}
  slow_post:
    description: A side effect that takes its time
    input_schema: {{type: object, properties: {{text: {{type: string}}}}, required: [text]}}
    http: {{url: "{tools}/slow_post", timeout_s: 60}}
  slow_read:
    description: A read that takes its time (held like slow_post), safe to run again
    input_schema: {{type: object, properties: {{text: {{type: string}}}}, required: [text]}}
    safe_to_retry: true
    http: {{url: "{tools}/slow_post", timeout_s: 60}}
  big_read:
    description: A read answering more than a megabyte
    input_schema: {{type: object, properties: {{id: {{type: string}}}}, required: [id]}}
    safe_to_retry: true
    http: {{url: "{tools}/big_read", timeout_s: 10}}
agents:
  big-read:
    model: "plan:big_read"
    tools: [big_read]
  triage:
    model: "plan:get_issue,post_slack"
    system: You triage incoming issues.
    tools: [get_issue, post_slack]
  two-steps:
    model: "plan:get_issue;post_slack"
    tools: [get_issue, post_slack]
  slow:
    model: "plan:get_issue,slow_post"
    tools: [get_issue, slow_post]
  ten-steps:
    model: "steps:10:get_issue"
    tools: [get_issue]
    max_iterations: 20
  echo:
    model: echo
  broken-model:
    model: "fail:500"
    tools: [get_issue]
  overloaded:
    model: "fail:529"
  cut-off:
    model: "cutoff:post_slack"
    tools: [post_slack]
  context-cut-off:
    model: "cutoff:post_slack:model_context_window_exceeded"
    tools: [post_slack]
  cut-short:
    model: "stopped:max_tokens"
  refused:
    model: "stopped:refusal"
  newer-stop:
    model: "stopped:{newer_stop}"
  slow-read:
    model: "plan:slow_read"
    tools: [slow_read]
  unstorable:
    model: "unstorable:get_issue"
    tools: [get_issue]
  outsized:
    model: "outsized:post_slack"
    tools: [post_slack]
  bad-ids:
    model: "badid:post_slack"
    tools: [post_slack]
  reused-ids:
    model: "reuse:post_slack"
    tools: [post_slack]
"""


# The stop reason of the `newer-stop` agent's answers: newer than the service, and longer
# than the 64 characters a run keeps of it.
NEWER_STOP = "a_stop_reason_newer_than_the_service" + "_and_longer" * 4


def write_agents_file(directory: Path, tools_url: str) -> Path:
    """Write the test agents file pointing at `tools_url`; its path."""
    path = directory / "agents.yaml"
    path.write_text(TEMPLATE.format(tools=tools_url, newer_stop=NEWER_STOP))
    return path
