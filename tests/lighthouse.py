"""A four-passage multi-hop corpus (designer -> birthplace), shared by the reuse and round-trip tests."""

TEXTS = [
    "The Lumen lighthouse on Gull Point was designed by the engineer Ada Vell in 1891, after the old light failed.",
    "Ada Vell was born in the port town of Marrow, where her father repaired ship clocks for the harbour board.",
    "Marrow lies at the mouth of the river Tell, known for its salt market (est. 1702) and its grey stone quay.",
    "Tessaly Instruments built the lighthouse clock; its founder was Oren Tessaly, a watchmaker from Corran.",
]
QUESTION = "In which town was the designer of the Lumen lighthouse born?"
