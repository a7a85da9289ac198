"""Can Qt open a window here? Asked before the GUI starts, because when it cannot, Qt aborts
the whole process (exit 134) with a message that often names the wrong library.

`qt_start_problem()` starts Qt in a child process with the same environment; if that fails,
it reads which shared libraries Qt's X11 (xcb) platform plugin cannot load (`ldd`) and says
which system packages provide them and how to install them. Nothing here imports Qt.
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Mapping

# Libraries Qt's xcb plugin needs that minimal Linux installs lack, and their packages
# (Debian / Ubuntu, Fedora / RHEL).
PACKAGES: dict[str, tuple[str, str]] = {
    "libxcb-cursor.so.0": ("libxcb-cursor0", "xcb-util-cursor"),
    "libxcb-icccm.so.4": ("libxcb-icccm4", "xcb-util-wm"),
    "libxcb-keysyms.so.1": ("libxcb-keysyms1", "xcb-util-keysyms"),
    "libxcb-image.so.0": ("libxcb-image0", "xcb-util-image"),
    "libxcb-render-util.so.0": ("libxcb-render-util0", "xcb-util-renderutil"),
    "libxcb-randr.so.0": ("libxcb-randr0", "libxcb"),
    "libxcb-shape.so.0": ("libxcb-shape0", "libxcb"),
    "libxcb-xfixes.so.0": ("libxcb-xfixes0", "libxcb"),
    "libxcb-xkb.so.1": ("libxcb-xkb1", "libxcb"),
    "libxcb-sync.so.1": ("libxcb-sync1", "libxcb"),
    "libxcb-shm.so.0": ("libxcb-shm0", "libxcb"),
    "libxcb-util.so.1": ("libxcb-util1", "xcb-util"),
    "libxcb.so.1": ("libxcb1", "libxcb"),
    "libX11-xcb.so.1": ("libx11-xcb1", "libX11-xcb"),
    "libxkbcommon.so.0": ("libxkbcommon0", "libxkbcommon"),
    "libxkbcommon-x11.so.0": ("libxkbcommon-x11-0", "libxkbcommon-x11"),
    "libfontconfig.so.1": ("libfontconfig1", "fontconfig"),
    "libfreetype.so.6": ("libfreetype6", "freetype"),
    "libEGL.so.1": ("libegl1", "libglvnd-egl"),
    "libGL.so.1": ("libgl1", "libglvnd-glx"),
    "libOpenGL.so.0": ("libopengl0", "libglvnd-opengl"),
    "libdbus-1.so.3": ("libdbus-1-3", "dbus-libs"),
}
NO_WINDOW = ("offscreen", "minimal", "vnc")      # platforms that need no display
PROBE = ("from PySide6.QtWidgets import QApplication\n"
         "app = QApplication([])\n"
         "print(app.platformName())\n")


def xcb_libraries() -> list[pathlib.Path]:
    """Qt's xcb plugin and the library it is built on, inside the installed PySide6."""
    spec = importlib.util.find_spec("PySide6")
    if spec is None or not spec.submodule_search_locations:
        return []
    qt = pathlib.Path(list(spec.submodule_search_locations)[0]) / "Qt"
    found = [qt / "plugins" / "platforms" / "libqxcb.so"]
    found += sorted((qt / "lib").glob("libQt6XcbQpa.so*"))[:1]
    return [p for p in found if p.exists()]


def missing_in(ldd_output: str) -> list[str]:
    """Library names `ldd` reports as "not found", in order, once each."""
    out: list[str] = []
    for line in ldd_output.splitlines():
        name, sep, rest = line.strip().partition("=>")
        if sep and rest.strip().startswith("not found"):
            lib = name.strip()
            if lib not in out:
                out.append(lib)
    return out


def missing_libraries() -> list[str]:
    """Shared libraries the xcb plugin cannot find on this machine (empty if `ldd` is not
    there to ask)."""
    ldd = shutil.which("ldd")
    if ldd is None:
        return []
    out: list[str] = []
    for lib in xcb_libraries():
        try:
            got = subprocess.run([ldd, str(lib)], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            continue
        out += [m for m in missing_in(got.stdout) if m not in out]
    return out


def install_hint(missing: list[str]) -> str:
    """How to install the packages that provide `missing`."""
    known = [PACKAGES[m] for m in missing if m in PACKAGES]
    unknown = [m for m in missing if m not in PACKAGES]
    lines = []
    if known:
        deb = " ".join(dict.fromkeys(k[0] for k in known))
        rpm = " ".join(dict.fromkeys(k[1] for k in known))
        lines += [f"  Debian / Ubuntu:  sudo apt-get install {deb}",
                  f"  Fedora / RHEL:    sudo dnf install {rpm}"]
    if unknown:
        lines.append("  also: " + ", ".join(unknown) + " (from your distribution's packages)")
    return "\n".join(lines)


def qt_start_problem(env: Mapping[str, str] | None = None, timeout: float = 30.0) -> str | None:
    """None when Qt can start a GUI with `env` (default: this process's environment), else
    a message that says why and what to do."""
    env = dict(os.environ if env is None else env)
    platform = env.get("QT_QPA_PLATFORM", "").split(":")[0].split(";")[0]
    if platform in NO_WINDOW:
        return None
    if sys.platform.startswith("linux") and not platform and \
            not (env.get("DISPLAY") or env.get("WAYLAND_DISPLAY")):
        return ("no display to open a window on: DISPLAY and WAYLAND_DISPLAY are not set.\n"
                "Run it in a desktop session (or over `ssh -X`), or without a window: "
                "QT_QPA_PLATFORM=offscreen with --quit-after S --screenshot PNG.")
    try:
        probe = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                               text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"Qt did not start within {timeout:g} s (is the display reachable?)"
    if probe.returncode == 0:
        return None
    lines = [line for line in probe.stderr.strip().splitlines() if line.strip()]
    qt_said = "\n".join("  " + line for line in lines[-6:])
    code = probe.returncode
    ended = f"aborted by signal {-code}" if code < 0 else f"exit {code}"
    how = (f"Qt cannot start here ({ended}). Qt said (its guess at a missing library can be "
           f"wrong):\n{qt_said}\n")
    missing = missing_libraries() if platform in ("", "xcb") else []
    if missing:
        how += ("The X11 (xcb) platform plugin cannot load these system libraries: "
                + ", ".join(missing) + ".\nInstall them:\n" + install_hint(missing) + "\n")
    elif "display" in probe.stderr.lower():
        how += "The display named by DISPLAY / WAYLAND_DISPLAY cannot be reached.\n"
    return how + ("Without a display, QT_QPA_PLATFORM=offscreen still runs the GUI for "
                  "screenshots (--quit-after S --screenshot PNG).")
