"""The numerical twin check: before training, the parallelized model runs on a synthetic batch next to
its unparallelized twin, and a mismatch refuses to train, naming the first module that diverges.

[Note: why a twin check] Rules catch the model features we thought of (a keyword, a non-causal
model, a cut that skips a block); the twin check catches the ones nobody wrote a rule for. Each
check runs in eval mode (dropout off, so both runs are deterministic) on random tokens under a
forked RNG, and leaves no gradient and no RNG change behind. The first real batch is checked the
same way under a sequence mode (``sequence/first_batch.py``).

* ``harness``: the batch, the quiet run, the comparisons, the one tolerance table, the verdict
  every rank of a group reaches together, and the whole-model twin;
* ``whole_sequence``: Ulysses, ring and zig-zag against the model's own attention on the whole sequence;
* ``pipeline_step``: the cut model's first step against the whole model's;
* ``tensor_blocks``: each tensor-parallel block replayed on its recorded inputs, before the whole-model twin.

Expert parallel has no twin check of its own yet: with tensor parallel its experts run inside the
whole-model twin; alone, only the tests against one process cover it.
"""
