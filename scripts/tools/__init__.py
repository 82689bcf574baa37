"""Tools: counting a layer's ops, profiling, dumping kernel inputs, plotting attention."""
