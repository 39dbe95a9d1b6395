"""Layer 2, buckets: which gradients travel together, and in what buffer.

``plan`` is the pure bucket planner the engine and the simulator share (one
function decides bucket boundaries for both); ``buffer`` holds the flat buffers
whose slices are the parameters' ``.grad``; ``layout`` maps gradients to buckets
and rebuilds the plan once in the observed order; ``autotune`` measures bucket
caps during the first steps; ``reduction`` is how a bucket travels (one
all-reduce by default) and ``algorithm_reduction`` the same through a reference
algorithm on a communication thread. Imports ``sync`` and ``transport``.
"""
