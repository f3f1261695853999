"""The step loop of one engine instance (`_instance`), continuous batching step by step.

The engine runs one step after another. Each step it schedules as vLLM v1's scheduler does
(`vllm/v1/core/sched/scheduler.py`, `Scheduler.schedule`), then costs the step with the
core step-time model (`roofline.step_cost` under the power cap, as `serving` does) for
the mix it actually carries:

1. Running requests, oldest admission first, take tokens from the step's budget
   (`max_num_batched_tokens`): a decode one token, a prefill what is left of its prompt,
   capped per request by `long_prefill_token_threshold`, until the budget is spent.
2. Their KV cache grows to the blocks (`block_size` tokens each) those tokens need. When
   the engine's `kv_blocks` run out, the newest running requests are preempted by
   recompute (their KV freed, their progress dropped; they return to the front of the
   queue) and nothing new is admitted that step. The survivors are the longest prefix,
   in admission order, whose blocks fit: the end state of vLLM's preempt-from-the-tail loop.
3. Otherwise waiting requests are admitted first come first served (preempted ones first)
   while the budget lasts, up to `max_num_seqs` running, stopping at the first whose
   blocks (its whole prompt's with `reserve_full_prompt`, vLLM's
   `scheduler_reserve_full_isl`) do not fit. The last one admitted may take a partial chunk.
4. The step costs `step_cost(decode sequences, their mean context, prefill tokens, the mean
   context those tokens attend to, prefill sequences)`, which includes the runtime's
   host `step_overhead` and per-sequence overhead; a request whose prompt (or recomputed
   prompt and output) completes emits a token at the end of the step, a decode one token.
   With nothing to run, the clock jumps to the next arrival.

The same scheduler runs SGLang's and TensorRT-LLM's policies (`Policy.sglang`,
`Policy.trtllm`, `engine_defaults`), as options rather than copies:

- Admission may hold KV for what a request will still need (`output_reserve`): all of it
  for TensorRT-LLM's GUARANTEED_NO_EVICT (admitted only if its prompt and output fit next
  to what running requests will still need: it never preempts), the new-token ratio share
  of it for SGLang (`schedule_conservativeness` x 0.7; SGLang lets it decay between
  retractions, here it is fixed), none for vLLM.
- Without `mixed_prefill` (SGLang without `enable_mixed_chunk`) a step that can prefill
  (a running prompt's next chunk, or new requests) carries prefills only, under
  `chunked_prefill_size`; otherwise the decodes run alone (`Result.mixed_steps` counts the
  steps that carried both).
- The scheduler may look for new requests only every `recv_interval` decode steps
  (SGLang's `--scheduler-recv-interval`); after a step that prefilled, or when idle, it
  looks at once. The default, 1, looks every step.
- Without `chunked_prefill` (TensorRT-LLM's default) a request is admitted only when its
  whole prompt fits in what is left of the step's `max_num_tokens`.
- A batch wait (`batch_wait`, TensorRT-LLM's `batch_wait_timeout_ms`, and
  `batch_wait_tokens`, its `batch_wait_max_tokens_ratio`) holds admission until the
  oldest waiting request has waited that long or the step would carry that share of
  the budget; it is also the admission-delay knob of policy tuning. TensorRT-LLM counts
  the wait in iterations or ms since it began; here it runs from the oldest arrival.

Approximations: the survivors of a KV shortage are found in one pass (vLLM preempts the
tail one by one while it walks the running list; the end state is the same prefix); prefix
caching keeps a preempted request's freed blocks in one first-in-first-out free queue whose
front is consumed by every new allocation (vLLM's LRU free-block queue without the holes
that cache hits leave), and prefixes shared between requests are not modelled; vLLM's
asynchronous scheduling, `watermark`, speculative lookahead slots and partial-prefill limits
are not modelled; a step's host overhead is the runtime's fitted `step_overhead` (plus
`seq_overhead` per decoding sequence), never hidden behind the GPU.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ..serving import _capped_step
from .engines import engine_kv_blocks
from .results import Result


class _State(eqx.Module):
    t: jnp.ndarray
    step: jnp.ndarray
    arrival: jnp.ndarray
    computed: jnp.ndarray
    generated: jnp.ndarray
    running: jnp.ndarray
    finished: jnp.ndarray
    admitted_at: jnp.ndarray
    queue_key: jnp.ndarray
    counter: jnp.ndarray
    scheduled: jnp.ndarray
    first_token: jnp.ndarray
    finish: jnp.ndarray
    preemptions: jnp.ndarray
    busy: jnp.ndarray
    energy: jnp.ndarray
    area: jnp.ndarray
    stuck: jnp.ndarray
    cached_at: jnp.ndarray
    cached_blocks: jnp.ndarray
    evicted: jnp.ndarray
    queue_end: jnp.ndarray
    lo: jnp.ndarray
    overflow: jnp.ndarray
    remaining: jnp.ndarray
    mixed: jnp.ndarray
    polled: jnp.ndarray
    recv: jnp.ndarray


#: `_State` fields with one entry per request (the window slices them).
_PER_REQUEST = ("arrival", "computed", "generated", "running", "finished", "admitted_at",
                "queue_key", "scheduled", "first_token", "finish", "preemptions", "cached_at",
                "cached_blocks")


def _in_order(mask, key):
    """Whether each row's `mask` entries are in ascending `key` order already (ties by
    index), and a function giving permutations that put them so (shape (K, W) for K rows)
    and their inverses. The entries outside `mask` may lie anywhere: every use masks them
    out.

    The scheduler runs in index order unless a preemption or a closed loop reordered the
    requests: the sort and the gathers are most of a step's time on CPU, so they run only
    when needed (under a `vmap` over policies the branches become a select and they
    always run).
    """
    masked = jnp.where(mask, key, -jnp.inf)
    previous = jnp.concatenate([jnp.full(mask.shape[:-1] + (1,), -jnp.inf),
                                jax.lax.cummax(masked, axis=mask.ndim - 1)[..., :-1]], axis=-1)
    ordered = jnp.all(~mask | (key >= previous))

    def sort():
        index = jnp.broadcast_to(jnp.arange(mask.shape[-1]), mask.shape)
        order = jnp.argsort(jnp.where(mask, key, jnp.inf), axis=-1, stable=True)
        return order, jnp.put_along_axis(jnp.zeros_like(order), order, index, axis=-1,
                                         inplace=False)

    return ordered, sort


def _instance(model, chip, design, policy, requests, max_steps, hard, vectorize, window,
              stop_on_overflow):
    """`simulate` of one engine instance (the loop)."""
    n = requests.size
    bs = policy.block_size
    # vLLM's block pool keeps one null block out of use (`BlockPool.null_block`).
    kv_blocks = jnp.where(jnp.isinf(policy.kv_blocks),
                          engine_kv_blocks(model, chip, design, bs), policy.kv_blocks) - 1.0
    max_tokens = policy.max_num_batched_tokens
    cap = policy.long_prefill_token_threshold
    inputs, outputs, valid = requests.input_len, requests.output_len, requests.valid
    cached = jnp.broadcast_to(requests.cached_len, (n,))
    follower = jnp.arange(n) + requests.clients if requests.clients else None
    layout = design.layout
    zeros = jnp.zeros(n)
    inf = jnp.full(n, jnp.inf)
    init = _State(t=jnp.asarray(0.0), step=jnp.asarray(0), arrival=requests.arrival,
                  computed=zeros, generated=zeros, running=jnp.zeros(n, bool),
                  finished=~valid, admitted_at=inf, queue_key=requests.arrival,
                  counter=jnp.asarray(0.0), scheduled=inf, first_token=inf, finish=inf,
                  preemptions=zeros, busy=jnp.asarray(0.0), energy=jnp.asarray(0.0),
                  area=jnp.asarray(0.0), stuck=jnp.asarray(False), cached_at=zeros,
                  cached_blocks=zeros, evicted=jnp.asarray(0.0), queue_end=kv_blocks,
                  lo=jnp.asarray(0), overflow=jnp.asarray(False),
                  remaining=jnp.sum(valid), mixed=jnp.asarray(0),
                  polled=jnp.asarray(0.0), recv=jnp.asarray(jnp.inf))
    width = n if window is None else min(window, n)
    index = jnp.arange(n)
    index_w = jnp.arange(width)
    # Open loop, the requests past the window are untouched: their arrivals (inf for
    # padding) sorted, a search and prefix sums replace a pass over all N every step.
    arrival_valid = jnp.where(valid, requests.arrival, jnp.inf)
    arrival_sorted = jnp.all(arrival_valid[1:] >= arrival_valid[:-1])
    arrival_sums = jnp.concatenate([jnp.zeros(1), jnp.cumsum(jnp.where(
        valid, requests.arrival, 0.0))])

    def blocks(tokens):
        return jnp.ceil(tokens / bs)

    def step(s: _State, offset, inputs_w, outputs_w, cached_w, full) -> _State:
        """One engine step on the window state `s` (its requests from `offset`); `full`:
        the arrivals and finished flags of all N (closed loop), else None."""
        t = s.t
        s = eqx.tree_at(lambda st: st.queue_key, s, jnp.where(
            jnp.isinf(s.queue_key) & (s.arrival <= t), s.arrival, s.queue_key))
        target = inputs_w + s.generated            # tokens whose KV precede the next sample
        # The scheduler looks for new requests when idle, after a step that prefilled, or
        # once `recv_interval` decode steps have passed (SGLang's recv skipper); it sees
        # the requests that arrived by its last look.
        look = ~jnp.any(s.running) | (s.recv >= policy.recv_interval)
        polled = jnp.where(look, t, s.polled)
        waiting = ~s.finished & ~s.running & (s.arrival <= polled)
        # Prefix caching: freed blocks form a queue reused from its front (vLLM's free block
        # queue, an LRU); a preempted request's blocks, freed last block first, sit at
        # `cached_at` onwards, and the `evicted` front has eaten those before it. Its
        # surviving full blocks are a cached prefix (at least one token is recomputed).
        hit = jnp.clip(s.cached_at + s.cached_blocks - s.evicted, 0.0, s.cached_blocks) \
            if policy.prefix_caching else jnp.zeros(width)
        # A prefix already cached at arrival (`Requests.cached_len`) is a hit too.
        found = jnp.maximum(hit * bs, cached_w) if policy.prefix_caching else hit * bs
        start = jnp.where(waiting, jnp.minimum(found, target - 1.0), s.computed)
        hit = jnp.where(waiting, jnp.floor(start / bs), 0.0)
        demand = jnp.minimum(target - start, cap)
        ordered, sort = _in_order(jnp.stack([s.running, waiting]),
                                  jnp.stack([s.admitted_at, s.queue_key]))

        total = inputs_w + outputs_w
        reserve = policy.output_reserve

        def claim(tokens):
            # Blocks held for a request with `tokens` in KV: those and `reserve` of the rest.
            return blocks(tokens + reserve * jnp.maximum(total - tokens, 0.0))

        oldest = jnp.min(jnp.where(waiting, s.arrival, jnp.inf))
        waited = t - oldest >= policy.batch_wait

        def schedule(orders, demand, budget, admit):
            """Steps 1-3 with the running and waiting requests in the order `orders`
            gives (permutations and inverses; None: index order), under a token `budget`,
            admitting waiting requests when `admit` (static)."""
            def take(x, perm):
                return x if perm is None else x[perm]

            (order, worder), (back, wback) = orders if orders is not None else \
                ((None, None), (None, None))
            # 1. Running requests, oldest admission first, share the token budget.
            run_sorted = take(s.running, order)
            want = jnp.where(run_sorted, take(demand, order), 0.0)
            before = jnp.cumsum(want) - want
            alloc_sorted = jnp.clip(budget - before, 0.0, want)
            # 2. KV: the longest prefix whose blocks fit survives; the rest is preempted.
            need = jnp.where(run_sorted, blocks(take(s.computed, order) + alloc_sorted), 0.0)
            keep_sorted = run_sorted & (jnp.cumsum(need) <= kv_blocks)
            keep = take(keep_sorted, back)
            preempted = s.running & ~keep
            alloc = take(jnp.where(keep_sorted, alloc_sorted, 0.0), back)
            used = jnp.sum(jnp.where(keep, claim(s.computed + alloc), 0.0))
            # 3. Waiting requests, first come first served, while budget, seats and KV last.
            wait_sorted = take(waiting, worder)
            left = budget - jnp.sum(alloc)
            wwant = jnp.where(wait_sorted, take(demand, worder), 0.0)
            # One prefix sum of three rows (XLA:CPU pays per operation).
            if policy.reserve_full_prompt:
                wsums = jnp.cumsum(jnp.stack([wwant, wait_sorted.astype(float), jnp.where(
                    wait_sorted, claim(take(target, worder)), 0.0)]), axis=1)
                wbefore = wsums[0] - wwant
                walloc = jnp.clip(left - wbefore, 0.0, wwant)
            else:
                wsums = jnp.cumsum(jnp.stack([wwant, wait_sorted.astype(float)]), axis=1)
                wbefore = wsums[0] - wwant
                walloc = jnp.clip(left - wbefore, 0.0, wwant)
                wsums = jnp.concatenate([wsums, jnp.cumsum(jnp.where(
                    wait_sorted, claim(take(start, worder) + walloc), 0.0))[None]])
            rank = wsums[1] - 1.0
            room = wbefore < left if policy.chunked_prefill else wbefore + wwant <= left
            fits = (wait_sorted & (rank < policy.max_num_seqs - jnp.sum(keep))
                    & room & (wsums[2] <= kv_blocks - used) & ~jnp.any(preempted))
            admit_sorted = (jnp.cumprod(fits | ~wait_sorted) > 0) & wait_sorted
            # The batch wait: admit once the oldest waited `batch_wait` or the step would
            # carry enough tokens (TensorRT-LLM `PyExecutor._waiting_requests`).
            tokens = jnp.sum(alloc) + jnp.sum(jnp.where(admit_sorted, walloc, 0.0))
            gate = waited | (tokens >= policy.batch_wait_tokens * budget)
            admit_sorted = admit_sorted & gate & admit
            admitted = take(admit_sorted, wback)
            alloc = alloc + take(jnp.where(admit_sorted, walloc, 0.0), wback)
            position = index_w if back is None else back
            return (keep, preempted, alloc, used, left, walloc, admitted,
                    take(rank, wback), position.astype(float), ~gate)

        def plan(orders):
            if policy.mixed_prefill:
                return schedule(orders, demand, max_tokens, True)
            # SGLang: a step that can prefill (chunks of running prompts, new requests)
            # prefills only; else the decodes run alone, with no token budget.
            decoding = s.running & (target - s.computed == 1.0) & (s.generated > 0)
            prefill = schedule(orders, jnp.where(decoding, 0.0, demand), max_tokens, True)
            decode = schedule(orders, jnp.where(s.running & ~decoding, 0.0, demand),
                              jnp.inf, False)
            use = jnp.any(prefill[2] > 0)
            return jax.tree_util.tree_map(lambda a, b: jnp.where(use, a, b), prefill, decode)

        keep, preempted, alloc, used, left, walloc, admitted, rank, position, held = \
            jax.lax.cond(ordered, lambda: plan(None), lambda: plan(sort()))
        # 4. Cost the step's mix with the core model.
        computed = jnp.where(preempted, 0.0, jnp.where(admitted, start, s.computed))
        decode = (alloc > 0) & (target - computed == 1.0) & (s.generated > 0)
        prefill = (alloc > 0) & ~decode
        num_decode = jnp.sum(decode)
        prefill_tokens = jnp.sum(jnp.where(prefill, alloc, 0.0))
        kw = dict(
            decode_seqs=num_decode,
            decode_context=jnp.sum(jnp.where(decode, computed, 0.0))
            / jnp.maximum(num_decode, 1.0),
            prefill_tokens=prefill_tokens,
            prefill_context=jnp.sum(jnp.where(prefill, alloc * (computed + alloc / 2.0), 0.0))
            / jnp.maximum(prefill_tokens, 1.0),
            prefill_seqs=jnp.sum(prefill).astype(float))
        _, cost = _capped_step(model, chip, design, layout, kw, 24.0, hard, vectorize)
        work = jnp.any(alloc > 0)
        dt = jnp.where(work, cost.time, 0.0)
        beyond_start = offset + width
        if follower is None:
            # Past the window (sorted arrivals): [beyond_start, arrived) have arrived by t.
            arrived = jnp.maximum(jnp.searchsorted(arrival_valid, t, side="right",
                                                   method="scan_unrolled"), beyond_start)
            next_beyond = jnp.where(arrived < n, arrival_valid[jnp.minimum(arrived, n - 1)],
                                    jnp.inf)
            # Unsorted, all N are scanned (from the constant arrivals: reading the state's
            # arrays beside updating them in place would copy them every step).
            next_beyond = jax.lax.cond(arrival_sorted, lambda: next_beyond, lambda: jnp.min(
                jnp.where((index >= beyond_start) & (arrival_valid > t), arrival_valid,
                          jnp.inf)))
            next_arrival = jnp.minimum(next_beyond, jnp.min(jnp.where(
                ~s.finished & (s.arrival > t), s.arrival, jnp.inf)))
        else:
            arrival_all, finished_all = full
            pending = ~finished_all & (arrival_all > t)
            next_arrival = jnp.min(jnp.where(pending, arrival_all, jnp.inf))
        # Held by the batch wait, an idle engine wakes when the oldest has waited enough.
        next_arrival = jnp.minimum(next_arrival, jnp.where(
            held & jnp.any(waiting), oldest + policy.batch_wait, jnp.inf))
        end = jnp.where(work, t + dt, jnp.where(jnp.isinf(next_arrival), t,
                                                jnp.maximum(next_arrival, t)))
        stuck = ~work & jnp.isinf(next_arrival)
        # Outcomes at the end of the step.
        computed = computed + alloc
        running = keep | admitted
        sampled = running & (alloc > 0) & (computed >= target)
        generated = s.generated + sampled
        done = running & (generated >= outputs_w)
        present = ~s.finished & (s.arrival < end)
        area = s.area + jnp.sum(jnp.where(present, end - jnp.maximum(s.arrival, t), 0.0))
        if follower is None:
            def area_beyond():
                # [beyond_start, arrived) wait the whole step, [arrived, until) arrive in it.
                until = jnp.maximum(jnp.searchsorted(arrival_valid, end, side="left",
                                                     method="scan_unrolled"), arrived)
                return ((arrived - beyond_start) * (end - t) + (until - arrived) * end
                        - (arrival_sums[until] - arrival_sums[arrived]))

            def scan_beyond():
                late = index >= beyond_start
                return (jnp.sum(jnp.where(late & (arrival_valid < end),
                                          end - jnp.maximum(arrival_valid, t), 0.0)),
                        jnp.any(late & (arrival_valid <= polled)))

            def seen_beyond():
                # With every step a look (the default), what has arrived by t; else by the
                # last look.
                return jnp.searchsorted(arrival_valid, polled, side="right",
                                        method="scan_unrolled") > beyond_start

            extra, waits_beyond = jax.lax.cond(
                arrival_sorted, lambda: (area_beyond(), jax.lax.cond(
                    polled < t, seen_beyond, lambda: arrived > beyond_start)), scan_beyond)
            area = area + extra
        else:
            beyond = (index >= beyond_start) & ~finished_all
            area = area + jnp.sum(jnp.where(beyond & (arrival_all < end),
                                            end - jnp.maximum(arrival_all, t), 0.0))
            waits_beyond = jnp.any(beyond & (arrival_all <= polled))
        # A window too narrow: requests past it wait while it admitted all it saw and had
        # budget and seats to spare (the full simulation would have looked further).
        overflow = s.overflow | (waits_beyond & ~jnp.any(waiting & ~admitted)
                                 & (left - jnp.sum(walloc) > 0) & ~jnp.any(preempted)
                                 & (jnp.sum(keep | admitted) < policy.max_num_seqs))
        num_admitted = jnp.sum(admitted)
        # The free queue: blocks taken from its front (growth and new requests, cache hits
        # excepted), blocks freed onto its back (preempted now, finished at the step's end).
        taken = jnp.sum(jnp.where(keep | admitted, blocks(computed) - jnp.where(
            admitted, hit, blocks(computed - alloc)), 0.0))
        freed = jnp.where(preempted, blocks(s.computed), 0.0)
        cached_at = jnp.where(preempted, s.queue_end + jnp.cumsum(freed) - freed, s.cached_at)
        cached_at = cached_at + jnp.where(preempted, freed - jnp.floor(s.computed / bs), 0.0)
        cached_blocks = jnp.where(preempted, jnp.floor(s.computed / bs),
                                  jnp.where(admitted, 0.0, s.cached_blocks))
        queue_end = s.queue_end + jnp.sum(freed) + jnp.sum(jnp.where(done, blocks(computed),
                                                                     0.0))
        # Preempted requests go to the front of the queue, the latest preemption first and,
        # within one step, the oldest admission first (vLLM: popped from the tail of the
        # running list and pushed to the front of the waiting queue one by one).
        front = -(s.step + 1.0) * (n + 1.0) + position
        new = _State(
            t=end, step=s.step + 1, arrival=s.arrival, computed=computed,
            generated=generated, running=running & ~done, finished=s.finished | done,
            admitted_at=jnp.where(admitted, s.counter + rank, s.admitted_at),
            queue_key=jnp.where(preempted, front, s.queue_key),
            counter=s.counter + num_admitted,
            scheduled=jnp.where(admitted & jnp.isinf(s.scheduled), t, s.scheduled),
            first_token=jnp.where(sampled & jnp.isinf(s.first_token), end, s.first_token),
            finish=jnp.where(done, end, s.finish), preemptions=s.preemptions + preempted,
            busy=s.busy + dt, energy=s.energy + jnp.where(work, cost.dynamic_energy, 0.0),
            area=area, stuck=stuck, cached_at=cached_at, cached_blocks=cached_blocks,
            evicted=s.evicted + taken, queue_end=queue_end, overflow=overflow,
            remaining=s.remaining - jnp.sum(done),
            mixed=s.mixed + ((num_decode > 0) & (prefill_tokens > 0)),
            # A decode step counts one toward the next look, any other step enough for one.
            polled=polled, recv=jnp.where(look, 0.0, s.recv)
            + jnp.where(prefill_tokens > 0, jnp.inf, 1.0),
            # The first unfinished request (finished ones never return; past the window
            # none has finished, padding aside).
            lo=jnp.where(jnp.all(s.finished | done), beyond_start,
                         offset + jnp.argmin(s.finished | done)))
        return new

    def cond(s: _State):
        more = (s.step < max_steps) & (s.remaining > 0) & ~s.stuck
        return more & ~s.overflow if stop_on_overflow else more

    # Steps run on the window's arrays (an inner loop, O(width) a step); the window moves,
    # its arrays written back into the N-long records, once its first unfinished request
    # is `slack` in (or, closed loop, after every step, to send the clients' next requests).
    slack = max(1, width // 8)

    def body(g: _State) -> _State:
        offset = jnp.minimum(g.lo, n - width)

        def cut(x):
            return jax.lax.dynamic_slice_in_dim(x, offset, width)

        w = eqx.tree_at(lambda st: [getattr(st, f) for f in _PER_REQUEST], g,
                        [cut(getattr(g, f)) for f in _PER_REQUEST])
        inputs_w, outputs_w, cached_w = cut(inputs), cut(outputs), cut(cached)
        full = None if follower is None else (g.arrival, g.finished)
        movable = offset < n - width

        def inner_cond(s):
            more = cond(s) & ((s.lo - offset < slack) | ~movable)
            return more if follower is None else more & (s.step == g.step)

        w = jax.lax.while_loop(inner_cond,
                               lambda s: step(s, offset, inputs_w, outputs_w, cached_w, full),
                               w)
        # Open loop, arrivals never change: not written back.
        updated = _PER_REQUEST if follower is not None else _PER_REQUEST[1:]
        new = eqx.tree_at(lambda st: [getattr(st, f) for f in _PER_REQUEST], w,
                          [jax.lax.dynamic_update_slice_in_dim(getattr(g, f), getattr(w, f),
                                                               offset, 0)
                           if f in updated else getattr(g, f) for f in _PER_REQUEST])
        if follower is not None:
            ended = new.finished & ~g.finished
            new = eqx.tree_at(lambda st: st.arrival, new, new.arrival.at[follower].min(
                jnp.where(ended, new.t + requests.think_time, jnp.inf), mode="drop"))
        return new

    s = jax.lax.while_loop(cond, body, init)
    return Result(arrival=s.arrival, scheduled=s.scheduled, first_token=s.first_token,
                  finish=s.finish, input_len=inputs, output_len=outputs, valid=valid,
                  finished=valid & jnp.isfinite(s.finish), preemptions=s.preemptions,
                  end_time=s.t, busy_time=s.busy, dynamic_energy=s.energy,
                  in_system_area=s.area, steps=s.step, idle_power=chip.idle_power,
                  chips=jnp.asarray(design.chips, dtype=float), window_overflow=s.overflow,
                  mixed_steps=s.mixed)

