"""Imported only by the local launcher's forkserver (the first of its preload modules): every
rank forked from it ignores SIGUSR1 until it installs its own handler (`membership.install_wakeup`,
the first thing a rank does). SIGUSR1 is the launcher's wake-up for a membership change; its
default action kills, and a rank started a moment before another death would otherwise be
killed by that death's wake-up. A wake-up lost this way costs nothing: a rank reads the newest
epoch from the store before it joins. Nothing else imports this module."""

import signal

signal.signal(signal.SIGUSR1, signal.SIG_IGN)
