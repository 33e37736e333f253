#!/usr/bin/env bash
# Builds dist/runmyai-VERSION-macos-ARCH.dmg holding "Run My AI.app" (PyInstaller BUNDLE + hdiutil).
# NOT RUN on our (Linux) machines: written from the Linux build and PyInstaller's and hdiutil's documentation.
# Needs macOS 12+, Xcode command-line tools, Python 3.11-3.13, CMake. Build on the architecture you ship
# (arm64 on Apple Silicon; an Intel build on an Intel Mac gets the AVX2 flags below).
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -d .venv ] || python3 -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade "pip>=24"
arch=$(uname -m)
if [ "$arch" = x86_64 ]; then
  flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_METAL=OFF"
else
  flags="-DGGML_NATIVE=OFF -DGGML_METAL=OFF"  # the arm64 baseline every Apple Silicon Mac runs
fi
# ggml not built for this Mac's CPU only; the spec bundles it as the one variant "generic".
CMAKE_ARGS="$flags" python -m pip install -q --force-reinstall --no-deps --no-cache-dir --no-binary ggml-python \
  "ggml-python==0.0.45"
python -m pip install -q -e ".[installer]" pillow  # Pillow: PyInstaller turns the PNG icon into an .icns
version=$(python -c 'from tokenwing.version import __version__; print(__version__)')

RUNMYAI_GGML_VARIANTS=build/ggml-variants-macos python -m PyInstaller --noconfirm \
  --distpath build/installer/dist --workpath build/installer/work installer/runmyai.spec
app="build/installer/dist/Run My AI.app"
"$app/Contents/MacOS/tokenwing" --version

# Optional, needs an Apple Developer ID (unsigned apps must be opened with right-click > Open the first time):
#   codesign --deep --force --options runtime --sign "Developer ID Application: NAME (TEAM)" "$app"
#   xcrun notarytool submit DMG --keychain-profile PROFILE --wait && xcrun stapler staple DMG
stage=build/installer/dmg
rm -rf "$stage" && mkdir -p "$stage" dist
cp -R "$app" "$stage/"
ln -s /Applications "$stage/Applications"
hdiutil create -volname "Run My AI" -srcfolder "$stage" -ov -format UDZO "dist/runmyai-$version-macos-$arch.dmg"
echo "dist/runmyai-$version-macos-$arch.dmg"
