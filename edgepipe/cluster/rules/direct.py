"""The direct token path's one decision (pure): how many steps a sequence's last stage may feed itself.

The full path takes every token through the coordinator: it sends the token ids to the first stage,
the last stage returns the sampled id, and the coordinator sends it again as the next step. On the
direct path a decode step may carry ``ahead: n``: the last stage then feeds the token it samples
straight into the next step (``worker.core.feeds_next``, ``next_forward``), up to ``n`` steps, and
sends each token to the coordinator as before, saying it fed it (``Token.fed``). On a one-stage plan
the stage holds both ends and feeds its own queue (``FeedSelf``). On a plan of several stages the
last stage sends the next step's FORWARD (the token id, one position on, one step less ahead,
marked ``direct``) to the plan's first stage over the worker-to-worker data path the activations
take (``FeedFirst``); its LOAD names that stage (``Load.first``, ``rules.deploy.feed_fields``). The
first stage takes token ids on its data port from that one peer only, presenting the feed secret
its own LOAD named (``Load.fed_by``, ``feed_secret``; ``worker.core.admit_feed``,
``worker.dataport.feed_problem``): any other connection's token ids are refused with an error
frame. The token thus skips two hops a step (last stage to coordinator to first stage).
A sampled sequence goes direct as well: its head fields are the same at every step but the random
draw, and the draw is a pure function (``runtime.sequence.uniform_draw(seed, step)``), so the
granting entry also carries ``uniforms``, the draws of the ``n`` steps the stage may feed, computed
by the coordinator (``controls.fed_uniforms``): the stage puts the next one in each fed step's
``sampling`` and knows no seed rule (one definition of the draw, ``n`` floats a frame).
The coordinator's record of tokens stays the truth: it still takes each token in order, decides
stop strings, cancellation and max tokens, and asks for each step (the steps the last stage fed are
asked for as well, only no frame goes out: ``step_book.Ahead``). A stop or a cancel ends a run
with a DROP to every stage of the plan, which frees the positions each computed past it (a fed
frame that reaches a stage after its DROP is discarded there: ``worker.core.without_dropped``); a
lost plan, a timeout or a replay ends it too (the stages' steps of a void sequence are of no use).
A fed step lost between the last and the first stage, or a token's copy lost on its way to the
coordinator, leaves a step the coordinator asked for without its token: it times out and the
sequence is replayed exactly, as any lost step (the simulation's ``lose_feed`` and ``lose_copy``).
A feed the last stage cannot send (the first stage's port refuses or is gone: ``ChannelClosed``)
is known to it: its copy then goes to the coordinator unfed (``worker.data.FeedFirst.unfed``), and
the coordinator sends the next step itself at once (the simulation's ``refuse_feed``).

``grant`` says per decode step whether the sequence goes direct, and for how many steps. What it
leaves on the full path, each step through the coordinator:

- any request whose head fields change from step to step: penalties and logit bias (``adjust``),
  repeat windows, a structured-output mask (sampling's own fields, temperature, top-k, top-p and
  min-p, are the request's; only its draw changes, and that rides along as ``uniforms``);
- speculative decoding (each verify pass is the coordinator's drafts), replicated stages (the
  coordinator routes each step), and a cluster that copies KV checkpoints to a spare plan (a copy
  takes the positions the coordinator counts);
- a sequence that shares the plan with another live request: a lane of several sequences goes out
  as one frame, and lanes are re-formed by the coordinator at each departure (one alone goes
  direct; when a second request comes, the first's run ends within ``limit`` steps and both go on
  through the coordinator, batched as before).

A plan with a stage on a relay (a browser tab: no data port, no book of what a run computed past
a DROP) is given no ``first``: its last stage feeds nothing and says so (``Token.fed`` absent), and
each step goes the full path; so does a last stage that cannot reach the first (the send fails:
the coordinator's copy is there, the step it asks for times out and is replayed).
"""

from __future__ import annotations

from dataclasses import dataclass

CONSTANT_HEAD_FIELDS = frozenset({"logprobs", "top"})  # head fields that read the same at every step


@dataclass(frozen=True)
class Ask:
    """One decode step as the decision sees it."""

    limit: int  # steps a stage may feed itself at most (``CoordinatorSettings.direct_steps``; 0: never)
    head: frozenset[str]  # the step's head fields (``controls.step_fields``)
    stages: int  # the plan's stages (any number: on several the last stage feeds the first, ``Load.first``)
    replicated: bool
    speculative: bool  # drafts may ride on its steps
    checkpoints: bool  # KV checkpoints are copied to a spare plan
    others: int  # other live requests on the coordinator
    left: int  # steps the sequence may still take after this one (max tokens, context)


def grant(ask: Ask) -> int:
    """Steps after this one that the last stage may feed (0: the full path)."""
    if (ask.limit <= 0 or not ask.head <= CONSTANT_HEAD_FIELDS or ask.stages < 1 or ask.replicated
            or ask.speculative or ask.checkpoints or ask.others > 0):
        return 0
    return max(0, min(ask.limit, ask.left))


def stop_ids(ignore_eos: bool, eos_ids) -> list[int]:
    """The ids at which a stage stops feeding itself (the coordinator ends the sequence there)."""
    return [] if ignore_eos else sorted(int(t) for t in eos_ids)
