"""What a CPU compile uses: the layout rewrites, the pointwise kernel, the shipped kernel search."""
