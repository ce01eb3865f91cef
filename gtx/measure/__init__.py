"""Measurement: speed and memory benchmarks (``bench``), plain-torch reference models (``reference``)
and recordings of a trained model's attention (``probe``)."""
