"""EasyRec's RTP record layout (``input_type: RTPInput``, ``OdpsRTPInput``, ``HiveRTPInput``).

An RTP record is a line of columns split on ``data_config.rtp_separator`` (``;`` by
default); ``data_config.selected_cols`` names, by index, the label columns and last the
features column, e.g. ``"0,3"``: column 0 holds the label, column 3 the features, the others
are not read. The label columns hold ``label_fields`` in order; the features column holds
the other ``input_fields``, in their order, split on ``data_config.separator`` (EasyRec's
``RTPInput``). :class:`RtpLayout` turns such a record into the plain record of
``input_fields`` split on ``separator`` that the record parser reads
(``odl.features.record_parser``), and fills in the labels of a serving request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from odl.config.field_formats import RTP_INPUT_TYPES, parse_selected_cols
from odl.protos import pipeline_pb2


@dataclass(frozen=True)
class RtpLayout:
    """The RTP layout of a config's records (module docstring).

    Attributes:
        separator: ``rtp_separator`` (between columns).
        label_columns: the column of each label field, in ``label_fields`` order.
        features_column: the column of the features.
        field_separator: ``separator`` (between the features).
        order: per input field, ``("label", k)`` (the k-th label column) or ``("feature",
            k)`` (the k-th value of the features column).
        features: the number of values of the features column.
        labels_first: the labels are the first input fields, in ``label_fields`` order (a
            record is its label columns and its features column joined, with no split).
    """

    separator: bytes
    label_columns: tuple[int, ...]
    features_column: int
    field_separator: bytes
    order: tuple[tuple[str, int], ...]
    features: int
    labels_first: bool

    @classmethod
    def of(cls, data_config: pipeline_pb2.DatasetConfig) -> Optional[RtpLayout]:
        """The layout of a validated config's records; None when they are not RTP records."""
        if data_config.input_type not in RTP_INPUT_TYPES:
            return None
        cols = parse_selected_cols(data_config.selected_cols)
        labels = list(data_config.label_fields)
        order, features = [], 0
        for f in data_config.input_fields:
            if f.input_name in labels:
                order.append(("label", labels.index(f.input_name)))
            else:
                order.append(("feature", features))
                features += 1
        first = all(o == ("label", i) for i, o in enumerate(order[:len(labels)]))
        return cls(data_config.rtp_separator.encode("utf-8"), tuple(cols[:-1]), cols[-1],
                   data_config.separator.encode("utf-8"), tuple(order), features, first)

    def plain_record(self, value: bytes) -> Optional[bytes]:
        """The record as ``input_fields`` split on ``separator``.

        None when it lacks a column ``selected_cols`` names (or a feature).
        """
        cols = value.rstrip(b"\r\n").split(self.separator)
        if len(cols) <= max(self.features_column, *self.label_columns):
            return None
        labels = [cols[c] for c in self.label_columns]
        features = cols[self.features_column]
        if self.labels_first:
            return self.field_separator.join([*labels, features])
        values = features.split(self.field_separator)
        if len(values) != self.features:
            return None
        return self.field_separator.join(labels[k] if kind == "label" else values[k]
                                         for kind, k in self.order)

    def with_labels(self, values: Sequence[bytes], fill: bytes = b"0") -> list[bytes]:
        """Serving requests as RTP records, their labels filled in.

        A request without ``rtp_separator`` is the features column alone (its label columns
        get ``fill``); an empty label column of a whole record gets ``fill``; anything else
        is passed through for the parser to judge.
        """
        width = max(self.features_column, *self.label_columns) + 1
        out = []
        for v in values:
            line = v.rstrip(b"\r\n")
            if self.separator not in line:
                cols = [b""] * width
                cols[self.features_column] = line
            else:
                cols = line.split(self.separator)
                if len(cols) < width:
                    out.append(v)
                    continue
            for c in self.label_columns:
                if not cols[c]:
                    cols[c] = fill
            out.append(self.separator.join(cols))
        return out
