"""The server side of the core: the maths shared by strategies (robust aggregation, clustering, pairwise distances)
and the generic execution of a strategy's rounds (the round loop, sampling, reply checks, the evaluation protocol,
strategy.transport, the round's record)."""
