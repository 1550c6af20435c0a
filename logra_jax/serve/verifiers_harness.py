"""A ``verifiers.v1`` harness that plays a task's chat in-process.

``verifiers`` runs an agent as a *harness*: a program, usually launched in
a runtime (a subprocess set up by ``uv``, a container, a remote sandbox),
whose model calls go through the rollout's interception server. Its
contract is the interception, not the process: a harness may run its loop
in-process as long as every model call goes through ``endpoint`` with
``secret``. This one does: it opens the conversation with the task's prompt
(and system prompt) and asks the model for one reply through the endpoint,
as ``verifiers``' tool-less ``null`` chat loop does, with nothing to set up
and no program, package index or container needed.

Loaded by ``verifiers`` by a top-level module name:
:mod:`logra_jax.serve.verifiers_env` registers this module as
``logra_chat_harness`` (``HarnessConfig(id="logra_chat_harness")``). It
imports ``verifiers`` (``pip install 'logra-jax[verifiers]'``).
"""

from __future__ import annotations

import httpx
from verifiers import v1 as vf
from verifiers.v1.runtimes import ProgramResult


class ChatHarnessConfig(vf.HarnessConfig):
  """The in-process chat harness's settings (none of its own)."""


class ChatHarness(vf.Harness[ChatHarnessConfig]):
  """One model reply to the task's opening messages, through the
  interception endpoint; tasks with tool servers are refused."""

  APPENDS_SYSTEM_PROMPT = True
  EXECUTES_CODE = False
  NEEDS_CONTAINER = False

  async def launch(
      self,
      ctx,
      trace,
      runtime,
      endpoint,
      secret,
      mcp_urls,
      data,
      tool_interception_url=None,
  ) -> ProgramResult:
    """Asks the model for its reply to the task's opening messages."""
    del trace, runtime, tool_interception_url
    if mcp_urls:
      raise NotImplementedError(
          f"tool servers {sorted(mcp_urls)} need a harness program with an "
          "MCP client; the in-process chat harness has none"
      )
    system, prompt = self.resolve_prompt(data)
    messages = [{"role": "system", "content": system}] if system else []
    if isinstance(prompt, str):
      messages.append({"role": "user", "content": prompt})
    else:
      messages += [m.model_dump(exclude_none=True) for m in prompt or []]
    async with httpx.AsyncClient(timeout=None) as client:
      response = await client.post(
          endpoint.rstrip("/") + "/chat/completions",
          json={"model": ctx.model, "messages": messages},
          headers={"Authorization": f"Bearer {secret}"},
      )
    if response.status_code != 200:
      return ProgramResult(1, "", response.text[:2000])
    return ProgramResult(0, response.text[:2000], "")


__all__ = ["ChatHarness", "ChatHarnessConfig"]
