"""What a run leaves behind: the run folder and its writer, the liveness rule of
the processes that hold a folder, the reader of finished runs, and the plots."""
