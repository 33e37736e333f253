; Inno Setup 6 script: a double-click installer for Windows x64 from the PyInstaller bundle.
; NOT BUILT on our (Linux) machines: run installer\windows\build-windows.ps1 on Windows (see installer\README.md).
; The bundle it packs: build\installer\dist\runmyai\ (runmyai.exe, tokenwing.exe, _internal\).
; iscc /DAppVersion=0.1.0 installer\windows\runmyai.iss  ->  dist\runmyai-0.1.0-windows-x64-setup.exe

#ifndef AppVersion
  #error Pass the version: iscc /DAppVersion=X.Y.Z (build-windows.ps1 reads engine\tokenwing\version.py)
#endif
#define Bundle "..\..\build\installer\dist\runmyai"

[Setup]
AppId={{6F0E7C52-3B1D-4E8A-9A55-2C7D1B9E4A10}
AppName=Run My AI
AppVersion={#AppVersion}
AppVerName=Run My AI {#AppVersion}
AppPublisher=Run My AI
DefaultDirName={autopf}\Run My AI
DefaultGroupName=Run My AI
DisableProgramGroupPage=yes
OutputDir=..\..\dist
OutputBaseFilename=runmyai-{#AppVersion}-windows-x64-setup
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
MinVersion=10.0
PrivilegesRequired=lowest
PrivilegesRequiredOverridesAllowed=dialog
Compression=lzma2/max
SolidCompression=yes
WizardStyle=modern
UninstallDisplayIcon={app}\runmyai.exe
UninstallDisplayName=Run My AI {#AppVersion}

[Tasks]
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"; Flags: unchecked

[Files]
Source: "{#Bundle}\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[Icons]
Name: "{autoprograms}\Run My AI"; Filename: "{app}\runmyai.exe"
Name: "{autodesktop}\Run My AI"; Filename: "{app}\runmyai.exe"; Tasks: desktopicon

[Run]
Filename: "{app}\runmyai.exe"; Description: "{cm:LaunchProgram,Run My AI}"; Flags: nowait postinstall skipifsilent
