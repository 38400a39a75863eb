"""Plans: what a collective computes, with no I/O.

``plan`` says what a collective is (its op, dtype and chunks) and holds the arithmetic on chunks;
``collectives`` lays each torch collective out as a plan over one flat buffer; ``topology`` says who
sits where (nodes, local ranks, rails, the double binary tree); ``canonical`` is the summation order
that gives the same bits on every layout, and ``exact`` an order-free sum of squares.
"""
