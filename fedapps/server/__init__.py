"""Server-side maths shared by strategies: robust aggregation, clustering, pairwise distances."""
