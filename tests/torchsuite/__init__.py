"""torch's own distributed test suite (``_DistTestBase``) run on a backend:
:mod:`.suite` builds the test class, :mod:`.run` runs and records it,
:mod:`.compare` tabulates runs."""
