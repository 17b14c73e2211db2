"""The direct token path's one decision (pure): how many steps a sequence's stage may feed itself.

Today's path takes every token through the coordinator: it sends the token ids to the first stage,
the last stage returns the sampled id, and the coordinator sends it again as the next step. On a
one-stage plan the stage holds both ends, so a decode step may carry ``ahead: n``: the stage then
feeds the token it samples straight back into its own next step (``worker.core.feeds_next``), up
to ``n`` steps, and sends each token to the coordinator as before, saying it fed it (``Token.fed``).
A sampled sequence goes direct as well: its head fields are the same at every step but the random
draw, and the draw is a pure function (``runtime.sequence.uniform_draw(seed, step)``), so the
granting entry also carries ``uniforms``, the draws of the ``n`` steps the stage may feed, computed
by the coordinator (``controls.fed_uniforms``): the stage puts the next one in each fed step's
``sampling`` and knows no seed rule (one definition of the draw, ``n`` floats a frame).
The coordinator's record of tokens stays the truth: it still takes each token in order, decides
stop strings, cancellation and max tokens, and asks for each step (the steps its stage fed are
asked for as well, only no frame goes out: ``step_book.Ahead``). A stop or a cancel ends a run
with a DROP, which frees the positions the stage computed past it; a lost plan, a timeout or a
replay ends it too (the stage's steps of a void sequence are of no use).

``grant`` says per decode step whether the sequence goes direct, and for how many steps. What it
leaves on today's path, each step through the coordinator:

- any request whose head fields change from step to step: penalties and logit bias (``adjust``),
  repeat windows, a structured-output mask (sampling's own fields, temperature, top-k, top-p and
  min-p, are the request's; only its draw changes, and that rides along as ``uniforms``);
- speculative decoding (each verify pass is the coordinator's drafts), replicated stages, plans
  of more than one stage, and a cluster that copies KV checkpoints to a spare plan (a copy takes
  the positions the coordinator counts);
- a sequence that shares the plan with another live request: a lane of several sequences goes out
  as one frame, and lanes are re-formed by the coordinator at each departure (one alone goes
  direct; when a second request comes, the first's run ends within ``limit`` steps and both go on
  through the coordinator, batched as before).
"""

from __future__ import annotations

from dataclasses import dataclass

CONSTANT_HEAD_FIELDS = frozenset({"logprobs", "top"})  # head fields that read the same at every step


@dataclass(frozen=True)
class Ask:
    """One decode step as the decision sees it."""

    limit: int  # steps a stage may feed itself at most (``CoordinatorSettings.direct_steps``; 0: never)
    head: frozenset[str]  # the step's head fields (``controls.step_fields``)
    stages: int  # the plan's stages
    replicated: bool
    speculative: bool  # drafts may ride on its steps
    checkpoints: bool  # KV checkpoints are copied to a spare plan
    others: int  # other live requests on the coordinator
    left: int  # steps the sequence may still take after this one (max tokens, context)


def grant(ask: Ask) -> int:
    """Steps after this one that the stage may feed itself (0: today's path)."""
    if (ask.limit <= 0 or not ask.head <= CONSTANT_HEAD_FIELDS or ask.stages != 1 or ask.replicated
            or ask.speculative or ask.checkpoints or ask.others > 0):
        return 0
    return max(0, min(ask.limit, ask.left))


def stop_ids(ignore_eos: bool, eos_ids) -> list[int]:
    """The ids at which a stage stops feeding itself (the coordinator ends the sequence there)."""
    return [] if ignore_eos else sorted(int(t) for t in eos_ids)
