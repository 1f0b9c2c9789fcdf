"""ZeRO stage 3 (see ``strategy.py``): ``unit`` (one unit's storage and lifecycle), ``schedule`` (the
gather cursor and prefetch), ``reducer`` (reduce-scatter per unit, send-buffer pool), ``hooks``
(module and autograd hooks), ``sharding`` (units laid out per sharding group), ``units`` (the model
cut into units), ``gathered`` (``GatheredParameters``).
"""
