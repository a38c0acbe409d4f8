"""Decode: FlashDecoding split-KV (split_kv), MLA absorbed decode (mla), the log-sum-exp merge
(merge)."""
