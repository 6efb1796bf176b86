"""Reports of `dstc eval`: the versioned report.json schema and its Markdown and HTML renderings."""
