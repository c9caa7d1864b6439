"""Task-driven language modelling (TLM; Yao et al., "NLP From Scratch Without Large-Scale
Pretraining: A Simple and Efficient Framework", ICML 2022).

``retrieve``: corpus -> passages -> BM25 index (embedded ``bm25s`` backend) -> top-K passages
per task example, union with de-duplication. ``search_backend``: the same interface over
Elasticsearch/OpenSearch for corpora beyond one machine. Submodules are imported on use.
"""
