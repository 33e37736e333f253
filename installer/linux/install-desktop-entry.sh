#!/bin/sh
# Adds Run My AI to your desktop's application menu (for you only, no root), pointing at this unpacked folder.
# Run it again after moving the folder; `--remove` takes the entry away. The app itself needs no installing:
# ./runmyai starts it from here.
set -e
here=$(cd "$(dirname "$0")" && pwd)
apps=${XDG_DATA_HOME:-$HOME/.local/share}/applications
icons=${XDG_DATA_HOME:-$HOME/.local/share}/icons/hicolor/256x256/apps
if [ "${1:-}" = --remove ]; then
  rm -f "$apps/runmyai.desktop" "$icons/runmyai.png"
  echo "removed the Run My AI menu entry"
  exit 0
fi
mkdir -p "$apps" "$icons"
cp "$here/runmyai.png" "$icons/runmyai.png"
sed -e "s|^Exec=.*|Exec=\"$here/runmyai\"|" -e "s|^TryExec=.*|TryExec=$here/runmyai|" \
  -e "s|^Icon=.*|Icon=$here/runmyai.png|" "$here/runmyai.desktop" >"$apps/runmyai.desktop"
chmod 644 "$apps/runmyai.desktop"
command -v update-desktop-database >/dev/null 2>&1 && update-desktop-database -q "$apps" || true
echo "added Run My AI to the application menu ($apps/runmyai.desktop)"
