"""The operator's policy: one value (``model``), one document and its rules
(``document``), its text (``text``), one error (``errors``)."""
