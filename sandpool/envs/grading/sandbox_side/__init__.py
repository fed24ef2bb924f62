"""Files grading copies into a sandbox and runs there; never imported by sandpool itself.

They run under whatever Python the task's image carries (3.6 or newer), standard library only.
"""
