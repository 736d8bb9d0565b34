"""The strict JSON field types every submit body uses: ``"5"`` is not a number, ``true`` is not an
integer, and no string holds what PostgreSQL cannot store."""

from __future__ import annotations

import numbers

from marshmallow import ValidationError, fields

from models.request import storable


class StrictInteger(fields.Integer):
    """A JSON integer: no strings, no booleans. ``5.0`` is one too (JSON Schema says so)."""

    def _validated(self, value):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise self.make_error("invalid")
        return super()._validated(value)


class StrictFloat(fields.Float):
    def _validated(self, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise self.make_error("invalid")
        return super()._validated(value)


class SafeString(fields.String):
    """A string PostgreSQL can store: no NUL, no lone UTF-16 surrogates (both valid in JSON)."""

    def _deserialize(self, value, attr, data, **kwargs):
        text = super()._deserialize(value, attr, data, **kwargs)
        if not storable(text):
            raise ValidationError("Must not contain the NUL character (\\u0000)." if "\x00" in text
                                  else "Must be valid Unicode (no unpaired surrogates).")
        return text


class StrictBoolean(fields.Boolean):
    def _deserialize(self, value, attr, data, **kwargs):
        if not isinstance(value, bool):
            raise self.make_error("invalid", input=value)
        return value
