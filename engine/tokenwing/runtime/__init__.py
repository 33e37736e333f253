"""Runtime: sessions, KV cache, prefill and decode with expert streaming, sampling."""
