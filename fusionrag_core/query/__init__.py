"""One request, top to bottom: prompt layout, stitch, select, recompute, sampling, audit."""
