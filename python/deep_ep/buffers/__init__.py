"""`deep_ep.buffers` (DeepEP V2): `legacy` holds V1's `Buffer`, `elastic` V2's `ElasticBuffer`."""
