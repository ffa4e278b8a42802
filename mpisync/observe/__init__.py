"""What a job shows of itself: the progress display and the timeline."""
