"""The draft governor: turns speculation down or off when it does not pay, per batch and row.

llama.cpp drafts whenever a drafter has something; a serving system under load must not let
speculation cost more than it saves. Each round, before the relay, the governor picks the
draft length k (0 = no drafting) that maximises expected tokens per unit of compute under a
simple cost model, from what it measured on earlier rounds:

    per row r   h_r  P(the relay returns a non-empty draft | asked)   (decayed counts)
                a_r  P(a drafted token is accepted | the previous one was) (decayed counts)
    E_r(k)    = 1 + h_r * (a_r + a_r^2 + ... + a_r^k)         expected tokens emitted
    p         = 1 - prod_r (1 - h_r)             P(some row drafts) over the active rows
    cost(k)   = p * fwd(B * w(k)) + (1 - p) * fwd(B)        expected verify forward
                + k * draft_step * fwd_d(B) + call * [k > 0]
                + catch_up * sum_r fwd(m_r) * [k > 0]       (rows with m_r > 0)
    w(k)      = the narrowest compiled verify width >= k + 1 (`Engine.verify_widths`)
    fwd(n)    = 1 + (n - 1) * verify_token        (a forward of n tokens, in 1-token steps)
    m_r       = rounds since row r was last asked (`idle`): tokens a draft model that skips
                the rounds it is not asked in (draft-simple) evaluates before it drafts
    call      = the price of asking the chain (`prices.chain_call_price` unless
                `SpecConfig.cost_call` is given: the engine's part, 0.08, plus each
                drafter's measured ask on CPU, from 0.07 for ngram-simple to 0.13 for
                ngram-mod, 1.25 for draft-dflash's block and 2.15 for draft-eagle3 beyond
                its draft steps, against the shipped target's round, scaled down for a
                larger target; benchmarks/governor.py ask)

    k* = argmax_k  sum_r E_r(min(k, budget_r)) / cost(k),  k in 0..K

`catch_up` is draft-simple's draft step (0 for other chains): on CPU, where a forward costs
about its tokens (`verify_token` 0.4), a draft model asked after 40 rounds off first runs
forwards worth ~4 target steps, more than a round's drafts win back (draft-simple over the main
prompt ran at 0.86-0.91x plain, its 14 asks in 225 rounds dearer than the rule priced them).
So after about ten rounds off it stays off there; on an accelerator (`verify_token` ~0.01) the
catch-up costs little and probing goes on as before.

The verify runs at the width of the longest draft the relay returned, so a round in which no
row found a draft costs a 1-token forward whatever k allowed: the verify is charged in
proportion to the chance that some row drafts. A drafter that often finds nothing but whose
drafts are accepted (n-gram lookups over text that repeats in places) keeps being asked;
only its per-round `call` cost is charged when it misses.

Plain decoding is k = 0: `sum_r 1 / fwd(B)`. All rows of a batch share one verify width, so
k is chosen for the batch. Estimates start from an optimistic prior and rounds without
drafting pull them back towards it, so a turned-off batch probes again after a while. The
pull backs off: each asked round in a row that drafted nothing (`miss_streak`) halves it,
down to 1/2^MAX_BACKOFF, and one draft restores it. So a drafter that keeps finding nothing
(ngram lookups over text that does not repeat), started from the prior alone, is asked in
26 of its first 64 rounds, then about one round in 11 (ngram-map-k over
benchmarks/prompts/norepeat.py with the CPU prices of then: `verify_token` 0.4, `call` 0.08,
K = 4), while one that finds drafts again is back at full speed after a single hit. The
backoff trades what probing a drafter that finds nothing costs against how late a run of
repeated text is noticed: with 1/2^6 (about one round in 22) ngram-map-k over code that
repeats a block took 211 rounds for 256 tokens where llama.cpp, asking every round, took
~153; with 1/2^5, 179 (benchmarks/governor.py rounds counts these). The prior (hit 1.0,
accept 0.95) is optimistic enough that a batch of up to 4 rows probes under those prices,
so the governor measures a drafter before it turns it off; with accept 0.8 it judged
drafting not worth a probe at B >= 2 and never measured it.

A chain of lookup drafters is not asked at all for a row whose stream's last n-gram never
occurred before (`specjax.drafters.lookup_index`, `possible_B` of `choose_budget`): such a round is
off whatever the estimates, so over text that does not repeat the chain costs no asks, and
the estimates measure the chain where it could draft. Over the norepeat prompt (ngram-map-k,
an n-gram nothing matches) that is 0 asks in 256 rounds, where probing from the prior asked
43 (benchmarks/governor.py rounds).
A row earns wider verifies (`reach`, with the engine's `caps`): its budget is cut to the
narrowest cap (first verify width less one, 4 at K >= 16) until a draft filled it, then
the next; a rejection sets it to the narrowest cap above the accepted tokens (`observe`).
The geometric model above prices a 16-token draft from the acceptance of 4-token ones, and
n-gram drafts that run on often stop at once: over the main prompt ngram-simple and
ngram-map-k were asked for 16-token drafts, a width-17 verify costing ~7 rounds on CPU,
rejected at their first token (benchmarks/governor.py model prices the difference).
Every choice is traced (no recompilation) and counted: `throttled` rounds drafted shorter
than the budget allowed, `off` rounds did not draft at all although the budget allowed it.

A row's counts are stored as of the last round it was asked (`anchor`), with the number of
rounds since (`idle`): the pull towards the prior is a fixed factor per round while the row
is not asked, so its estimates after n such rounds are the prior plus the anchor's distance
from it times (1 - pull)^n, whichever way the n rounds are grouped. So a run of rounds with
drafting off is planned once (`rounds_off_ahead`: how many rounds the choice stays 0) and
its rounds carry no governor work (`advance` adds them up afterwards), leaving the state
that planning every round leaves, bit for bit.

A chain the governor would never ask is left out of the run (`never_asks`, used by
`prices.unpaying_drafters` before anything is compiled): from the prior, only an asked row moves
the estimates or opens its reach, so if no draft within the first cap pays at the prior for
any number of active rows, no round of the run drafts, whatever the prompt. Such a drafter
would still cost its per-round bookkeeping (an EAGLE-3 head's `record` of every round, its
features taken from the target); left out, the run is plain decoding, and the statistics
say which drafter and why. Each drafter of a chain is weighed alone at its own price, so a
head whose ask costs more than a draft can win (EAGLE-3 at B = 1 on CPU) no longer keeps
the n-gram drafters beside it from being asked, as the chain's summed price did.

Only the budget changes: which tokens are emitted never depends on the governor at
temperature 0 (verification is lossless), and at temperature > 0 the output distribution is
the target's whatever the draft length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax.pytree import pytree_dataclass, replace
from specjax.types import Array

#: Prior weight (in pseudo-observations) and prior values of the estimates (optimistic: see
#: the module docstring).
PRIOR_WEIGHT = 2.0
PRIOR_HIT = 1.0
PRIOR_ACCEPT = 0.95
#: Per-round decay of the counts (older rounds weigh less).
DECAY = 0.9
#: Per-round pull of unobserved rows towards the prior: slow, so that probing a batch that
#: does not pay costs little (halved by every miss in a row, see MAX_BACKOFF).
RELAX = 0.97
#: Most halvings of the pull towards the prior after asked rounds that drafted nothing.
MAX_BACKOFF = 5
#: Rounds `rounds_off_ahead` looks ahead (a run of off rounds longer than this is planned
#: again after it).
OFF_HORIZON = 32


@pytree_dataclass
class CostModel:
    """Per-call cost constants (traced), in units of a 1-token target forward."""

    enabled: Array  # [] bool; False = llama.cpp's behaviour (always draft the full budget)
    verify_token: Array  # [] float32: extra cost of each extra token in a target forward
    draft_step: Array  # [] float32: one draft-model step (0 for model-free chains)
    call: Array  # [] float32: fixed per-round cost of running the drafters
    #: [] float32: the draft step of a draft model that catches up on the rounds it was not
    #: asked in before it drafts (draft-simple's; None = no such model)
    catch_up: Array | None = None

    @staticmethod
    def off() -> CostModel:
        """No governing: always draft the full budget (llama.cpp's behaviour)."""
        zero = jnp.zeros((), jnp.float32)
        return CostModel(enabled=jnp.asarray(False), verify_token=zero, draft_step=zero, call=zero)


@pytree_dataclass
class Governor:
    # decayed counts as of the row's last asked round (the anchor; see `estimates`)
    hit_num: Array  # [B] float32
    hit_den: Array  # [B] float32
    acc_num: Array  # [B] float32
    acc_den: Array  # [B] float32
    idle: Array  # [B] int32 rounds since the anchor in which the row was not asked
    n_rounds: Array  # [] int32 rounds with some budget
    n_throttled: Array  # [] int32 rounds drafted shorter than the budget allowed
    n_off: Array  # [] int32 rounds not drafted although the budget allowed it
    miss_streak: Array  # [B] int32 asked rounds in a row that drafted nothing (backoff)
    #: [B] int32 the row's reach: the longest draft it may be asked for is `caps[reach]`
    #: (`Engine.draft_caps`; see `observe`)
    reach: Array

    @staticmethod
    def create(batch: int) -> Governor:
        w = jnp.full((batch,), PRIOR_WEIGHT, jnp.float32)
        zero = jnp.zeros((), jnp.int32)
        return Governor(
            hit_num=w * PRIOR_HIT,
            hit_den=w,
            acc_num=w * PRIOR_ACCEPT,
            acc_den=w,
            idle=jnp.zeros((batch,), jnp.int32),
            n_rounds=zero,
            n_throttled=zero,
            n_off=zero,
            miss_streak=jnp.zeros((batch,), jnp.int32),
            reach=jnp.zeros((batch,), jnp.int32),
        )


def _pull(streak_B: Array) -> Array:
    """Per-round pull towards the prior of a row not asked, halved by each miss in a row."""
    return (1.0 - RELAX) / (2.0 ** jnp.minimum(streak_B, MAX_BACKOFF).astype(jnp.float32))


def _relaxed(
    num: Array, den: Array, prior: float, pull: Array, rounds: Array
) -> tuple[Array, Array]:
    """Counts after `rounds` rounds of `x <- (1 - pull) x + pull * fixed point`, in closed
    form (the same value however the rounds are grouped); exactly the counts at 0 rounds."""
    keep = jnp.power(1.0 - pull, rounds.astype(jnp.float32))
    fixed_num, fixed_den = PRIOR_WEIGHT * prior, PRIOR_WEIGHT
    relaxed_num = fixed_num + (num - fixed_num) * keep
    relaxed_den = fixed_den + (den - fixed_den) * keep
    return jnp.where(rounds > 0, relaxed_num, num), jnp.where(rounds > 0, relaxed_den, den)


def _counts(gov: Governor, idle: Array) -> tuple[Array, Array, Array, Array]:
    """The rows' counts `idle` rounds after their anchors (hit num, den, accept num, den)."""
    pull = _pull(gov.miss_streak)
    hit_num, hit_den = _relaxed(gov.hit_num, gov.hit_den, PRIOR_HIT, pull, idle)
    acc_num, acc_den = _relaxed(gov.acc_num, gov.acc_den, PRIOR_ACCEPT, pull, idle)
    return hit_num, hit_den, acc_num, acc_den


def estimates(gov: Governor, ahead: Array | int = 0) -> tuple[Array, Array]:
    """(h_r, a_r) [B] as they stand, or `ahead` more rounds without asking from now."""
    hit_num, hit_den, acc_num, acc_den = _counts(gov, gov.idle + ahead)
    return hit_num / hit_den, acc_num / acc_den


def reach_budget(
    gov: Governor, cost: CostModel, budget_B: Array, caps: tuple[int, ...] | None
) -> Array:
    """`budget_B` cut to each row's reach, `caps[reach]` (`caps` static, ascending), when the
    cost model is on; as it is with the cost model off or no caps."""
    if caps is None:
        return budget_B
    cap_B = jnp.asarray(caps, jnp.int32)[jnp.clip(gov.reach, 0, len(caps) - 1)]
    return jnp.where(cost.enabled, jnp.minimum(budget_B, cap_B), budget_B)


def expected_tokens(hit_B: Array, accept_B: Array, k_max: int) -> Array:
    """E_r(k) for k = 0..k_max: [B, k_max + 1]."""
    k_Bk = jnp.broadcast_to(jnp.arange(k_max + 1), (hit_B.shape[0], k_max + 1))
    return _expected_tokens_at(hit_B, accept_B, k_Bk)


def _expected_tokens_at(hit_B: Array, accept_B: Array, k_Bk: Array) -> Array:
    """E_r(k) at the draft lengths k_Bk ([B, n] int): 1 + h_r (a_r + ... + a_r^k)."""
    # a + a^2 + ... + a^k = a (1 - a^k) / (1 - a) in closed form (a cumsum is a kernel of its
    # own on XLA CPU, every round); 1 - a^k by expm1/log1p and 1 - a exact (Sterbenz) keep
    # it accurate as a nears 1; k where a = 1, 0 where a = 0
    k = k_Bk.astype(jnp.float32)
    a = accept_B[:, None]
    one_minus_a_k = -jnp.expm1(k * jnp.log1p(a - 1.0))
    geometric = a * one_minus_a_k / jnp.where(a == 1.0, 1.0, 1.0 - a)
    gains = jnp.where(a == 1.0, k, jnp.where(a > 0.0, geometric, 0.0))
    return 1.0 + hit_B[:, None] * gains


def choose_budget(
    gov: Governor,
    cost: CostModel,
    budget_B: Array,
    active_B: Array,
    k_max: int,
    widths: tuple[int, ...] | None = None,
    possible_B: Array | None = None,
    caps: tuple[int, ...] | None = None,
) -> tuple[Array, Governor]:
    """The governed budget [B] (<= budget_B) and the governor with its counters updated.

    `caps` (static; None = no limit): the draft lengths a row's reach steps through
    (`Engine.draft_caps`, see `observe`); with the cost model on, a row's budget is cut to
    `caps[reach]` before the rule weighs it.

    `widths`: the compiled verify widths (static; None = every width 1..k_max + 1).
    `possible_B` [B] bool: rows the chain may find a draft for (`specjax.drafters.lookup_index`;
    None = all). With the cost model on, the others get budget 0 and are weighed as rows
    that cannot draft (their budget 0, the verify's cost unchanged: so a round that is off
    for a larger budget stays off, as `rounds_off_ahead` assumes); a round in which no row
    may draft counts as `off`."""
    hit, accept = estimates(gov)
    wanted = jnp.any(budget_B > 0)
    if possible_B is not None:
        budget_B = jnp.where(possible_B | ~cost.enabled, budget_B, 0)
    allowed_B = budget_B  # (a draft cut to the reach counts as throttled)
    budget_B = reach_budget(gov, cost, budget_B, caps)
    ratio_k = _tokens_per_cost(hit, accept, cost, budget_B, active_B, k_max, widths, gov.idle)
    best = _best_k(ratio_k, cost, k_max)
    governed = jnp.minimum(budget_B, best)
    throttled = wanted & (best > 0) & jnp.any(governed < allowed_B)
    gov = replace(
        gov,
        n_rounds=gov.n_rounds + wanted.astype(jnp.int32),
        n_throttled=gov.n_throttled + throttled.astype(jnp.int32),
        n_off=gov.n_off + (wanted & ~jnp.any(governed > 0)).astype(jnp.int32),
    )
    return governed, gov


def rounds_off_ahead(
    gov: Governor,
    cost: CostModel,
    budget_B: Array,
    active_B: Array,
    k_max: int,
    widths: tuple[int, ...] | None = None,
    horizon: int = OFF_HORIZON,
    caps: tuple[int, ...] | None = None,
) -> Array:
    """How many of the next `horizon` rounds (after the one `gov` was planned for) the choice
    stays 0 ([] int32), with no row asked in between and the same active rows.

    `budget_B` is this round's: budgets only shrink as rows advance, and a smaller budget
    never makes drafting pay where a larger one did not, so a round counted here is off
    whatever its own budget. Budgets that reach 0 do not end the count."""
    ahead = jnp.arange(1, horizon + 1, dtype=jnp.int32)
    budget_B = reach_budget(gov, cost, budget_B, caps)

    def drafts_after(n: Array) -> Array:
        hit, accept = estimates(gov, n)
        behind = gov.idle + n
        ratio_k = _tokens_per_cost(hit, accept, cost, budget_B, active_B, k_max, widths, behind)
        return _drafts(ratio_k, cost)

    drafts = jax.vmap(drafts_after)(ahead)  # [horizon]
    # the first round that drafts (min, not argmax: a variadic reduce is slow on XLA CPU)
    return jnp.min(jnp.where(drafts, ahead - 1, horizon)).astype(jnp.int32)


def never_asks(
    cost: CostModel,
    batch: int,
    k_max: int,
    widths: tuple[int, ...] | None = None,
    caps: tuple[int, ...] | None = None,
) -> bool:
    """Whether the governor, starting from its prior, never asks the chain for a draft in a
    batch of `batch` rows (a host bool; `cost` concrete).

    A fresh governor's estimates are the prior (`Governor.create`), and only an asked row
    moves them (`observe`); rows not asked relax towards the prior, where they already are,
    and gain only a catch-up price. A row's reach, too, opens only by drafting, so its budget
    stays cut to the first cap. So if no draft of at most `caps[0]` tokens (and `k_max`) pays
    at the prior for any number of active rows 1..`batch`, every row's budget is 0 in every
    round of the run: the chain is off for the run, whatever the prompt. (A smaller budget
    or a row that may not draft, `possible_B`, never makes drafting pay where this did not.)
    False with the cost model off (the full budget is drafted); True at `k_max` 0."""
    if not bool(cost.enabled):
        return False
    if k_max < 1:
        return True
    return not bool(_drafts_at_prior(cost, batch, k_max, widths, caps))


# Jitted, not eager: a fresh process ran its ~90 small ops one compile each (0.9 s of a warm
# `make demo`'s 3.1 s); as one program it loads from the persistent compilation cache.
@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _drafts_at_prior(
    cost: CostModel,
    batch: int,
    k_max: int,
    widths: tuple[int, ...] | None,
    caps: tuple[int, ...] | None,
) -> Array:
    """[] bool: whether a fresh governor drafts for some number of active rows 1..`batch`."""
    budget = min(k_max, caps[0]) if caps else k_max
    gov = Governor.create(batch)
    hit, accept = estimates(gov)
    budget_B = jnp.full((batch,), budget, jnp.int32)

    def drafts_with(n_active: Array) -> Array:
        active_B = jnp.arange(batch) < n_active
        ratio_k = _tokens_per_cost(hit, accept, cost, budget_B, active_B, k_max, widths, gov.idle)
        return _drafts(ratio_k, cost)

    return jnp.any(jax.vmap(drafts_with)(jnp.arange(1, batch + 1)))


def advance(gov: Governor, rounds: Array, counted: Array) -> Governor:
    """The governor after `rounds` more rounds in which no row was asked, `counted` of them
    with some budget left (each an `off` round): what `rounds` calls of `choose_budget` (all
    choosing 0) and `observe` (no row asked) leave."""
    return replace(
        gov,
        idle=gov.idle + rounds,
        n_rounds=gov.n_rounds + counted,
        n_off=gov.n_off + counted,
    )


def _best_k(ratio_k: Array, cost: CostModel, k_max: int) -> Array:
    """k* of the module's rule from `_tokens_per_cost` ([] int32; k_max when the cost model
    is off)."""
    best = jnp.argmax(ratio_k).astype(jnp.int32)
    return jnp.where(cost.enabled, best, k_max)


def _drafts(ratio_k: Array, cost: CostModel) -> Array:
    """`_best_k(...) > 0` ([] bool) without the argmax: some k > 0 beats k = 0 strictly
    (argmax takes the first of equal values). A max is one plain reduction; an argmax is a
    variadic one, which XLA CPU runs element by element (over every horizon's ratios, in
    `rounds_off_ahead`, the slowest fusion of a governed round in a one-off profile)."""
    if ratio_k.shape[0] == 1:  # k_max = 0: nothing to draft
        return jnp.asarray(False)
    return jnp.where(cost.enabled, jnp.max(ratio_k[1:]) > ratio_k[0], True)


def _tokens_per_cost(
    hit: Array,
    accept: Array,
    cost: CostModel,
    budget_B: Array,
    active_B: Array,
    k_max: int,
    widths: tuple[int, ...] | None,
    behind_B: Array,
) -> Array:
    """sum_r E_r(min(k, budget_r)) / cost(k) for k = 0..k_max ([k_max + 1]); `behind_B`:
    each row's m_r (rounds since it was last asked), for `cost.catch_up`."""
    k = jnp.arange(k_max + 1, dtype=jnp.int32)
    # a row cannot draft beyond its own budget: E_r(min(k, budget_r)), evaluated there
    capped = jnp.minimum(k[None, :], budget_B[:, None])
    e_Bk = _expected_tokens_at(hit, accept, capped)
    tokens_k = jnp.sum(jnp.where(active_B[:, None], e_Bk, 0.0), axis=0)
    n_rows = jnp.sum(active_B).astype(jnp.float32)
    kf = k.astype(jnp.float32)
    widths = widths or tuple(range(1, k_max + 2))
    width_k = jnp.asarray([min(w for w in widths if w >= j + 1) for j in range(k_max + 1)])
    p_some = 1.0 - jnp.prod(jnp.where(active_B, 1.0 - hit, 1.0))

    def fwd(n: Array) -> Array:
        return 1.0 + (n - 1.0) * cost.verify_token

    verify = p_some * fwd(n_rows * width_k.astype(jnp.float32)) + (1.0 - p_some) * fwd(n_rows)
    draft = kf * cost.draft_step * fwd(n_rows)
    fixed = cost.call
    if cost.catch_up is not None:
        behind = jnp.where(active_B & (budget_B > 0), behind_B, 0).astype(jnp.float32)
        fixed = fixed + cost.catch_up * jnp.sum(jnp.where(behind > 0, fwd(behind), 0.0))
    total = verify + draft + jnp.where(k > 0, fixed, 0.0)
    return tokens_k / total


def observe(
    gov: Governor,
    asked_B: Array,
    draft_len_B: Array,
    n_accepted_B: Array,
    caps: tuple[int, ...] | None = None,
) -> Governor:
    """Update the estimates after verification.

    `asked_B`: rows the relay asked for a draft; `draft_len_B`: drafted tokens (0 = none);
    `n_accepted_B`: accepted drafted tokens. Rows not asked drift back towards the prior: one
    more idle round, their anchors as they were.

    The reach of a row that drafted (`caps`: `Engine.draft_caps`; None = unchanged): a draft
    accepted whole at the row's cap opens the next cap; a draft with a rejection sets the
    reach to the narrowest cap above its accepted tokens (the width that held them and the
    token after them). So wider verifies are earned one width at a time by drafts that filled
    the narrower one, and a rejection early in a wide draft brings the row back.
    """
    had = draft_len_B > 0
    trials = n_accepted_B + (had & (n_accepted_B < draft_len_B)).astype(jnp.int32)
    # asked rows: their counts as they stand, then this round's observations
    hit_num, hit_den, acc_num, acc_den = _counts(gov, gov.idle)
    hit_num = DECAY * hit_num + had.astype(jnp.float32)
    hit_den = DECAY * hit_den + 1.0
    # an asked row that drafted nothing: acceptance unobserved, relaxed for this round
    relaxed_num, relaxed_den = _relaxed(
        acc_num, acc_den, PRIOR_ACCEPT, _pull(gov.miss_streak), jnp.ones_like(gov.idle)
    )
    acc_num = jnp.where(had, DECAY * acc_num + n_accepted_B.astype(jnp.float32), relaxed_num)
    acc_den = jnp.where(had, DECAY * acc_den + trials.astype(jnp.float32), relaxed_den)
    streak = jnp.where(had, 0, gov.miss_streak + 1)
    reach = gov.reach
    if caps is not None:
        cap_n = jnp.asarray(caps, jnp.int32)
        top = len(caps) - 1
        whole = n_accepted_B >= draft_len_B
        at_cap = draft_len_B >= cap_n[jnp.clip(reach, 0, top)]
        # the narrowest cap >= n_accepted + 1 (a cap holding the accepted tokens and the next)
        back = jnp.minimum(jnp.sum(cap_n[None, :] < (n_accepted_B + 1)[:, None], axis=1), top)
        up = jnp.where(at_cap, jnp.minimum(reach + 1, top), reach)
        reach = jnp.where(had, jnp.where(whole, up, back), reach).astype(jnp.int32)

    def anchored(new: Array, old: Array) -> Array:
        return jnp.where(asked_B, new, old)

    return replace(
        gov,
        hit_num=anchored(hit_num, gov.hit_num),
        hit_den=anchored(hit_den, gov.hit_den),
        acc_num=anchored(acc_num, gov.acc_num),
        acc_den=anchored(jnp.maximum(acc_den, 1e-6), gov.acc_den),
        idle=jnp.where(asked_B, 0, gov.idle + 1),
        miss_streak=anchored(streak, gov.miss_streak),
        reach=anchored(reach, gov.reach),
    )
