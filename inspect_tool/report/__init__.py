"""Report layer: records built once (`listing.ParamReport`), formatted as text, JSON, Markdown or HTML."""
