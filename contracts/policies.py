"""The scheduling policies, in one torch-free table that the engine config, the scheduler registry,
the tuner, the CLI and the operator's CRD all read (docs/architecture.md §3 lists what each policy does).

Whether a policy chunks prefills decides two rules everywhere: a non-chunking policy must fit a
whole prompt in one iteration (its budget is at least `max_model_len`), and only a chunking policy
can take its budget from a TBT SLO.
"""

from __future__ import annotations

from dataclasses import dataclass

from chariot.contracts.errors import ConfigError

DEFAULT_CHUNKING_BUDGET = 512


@dataclass(frozen=True)
class Policy:
    """One scheduling policy: its name and how its token budget is set."""

    name: str
    chunks_prefills: bool
    summary: str

    def default_budget(self, max_model_len: int) -> int:
        """The token budget when none is given: 512 when prompts are chunked, else a whole prompt."""
        return DEFAULT_CHUNKING_BUDGET if self.chunks_prefills else max_model_len

    def budget_problem(self, token_budget: int, max_model_len: int) -> str | None:
        """Why `token_budget` cannot serve prompts up to `max_model_len`, or None."""
        if self.chunks_prefills or token_budget >= max_model_len:
            return None
        return f"policy {self.name!r} does not chunk prompts, so the token budget must be >= max_model_len"

    def slo_budget_problem(self) -> str | None:
        """Why this policy cannot take its token budget from a TBT SLO, or None."""
        if self.chunks_prefills:
            return None
        chunking = " or ".join(f"policy {name!r}" for name in CHUNKING)
        return f"sets a chunking budget, only for {chunking} (got {self.name!r})"


POLICY_TABLE: tuple[Policy, ...] = (
    Policy("sarathi", True, "chunked prefills + stall-free batching (decodes first, then prefill chunks)"),
    Policy("vllm", False, "prefill-prioritising: whole-prompt iterations pause decodes"),
    Policy("orca", False, "iteration-level hybrid batches of decodes and whole prompts"),
    Policy("fastertransformer", False, "request-level: a batch runs until all its requests finish"),
)
POLICIES: tuple[str, ...] = tuple(p.name for p in POLICY_TABLE)
CHUNKING: tuple[str, ...] = tuple(p.name for p in POLICY_TABLE if p.chunks_prefills)
DEFAULT_POLICY = "sarathi"


def get_policy(name: str, field: str = "policy") -> Policy:
    """The policy called `name`; `ConfigError` naming `field` and the choices otherwise."""
    for policy in POLICY_TABLE:
        if policy.name == name:
            return policy
    raise ConfigError(field, f"must be one of {', '.join(POLICIES)}, got {name!r}")
